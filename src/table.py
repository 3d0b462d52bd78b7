"""The paper's table of a task family for run or policy folders (code: mrtpo.evaluate.tables).

python src/table.py text2sql logs/train/multiruns/<gdpo> logs/train/multiruns/<mrtpo>
python src/table.py ifeval <run> <run> --set rollout=vllm --set eval.limit=100
"""

import sys

from mrtpo.evaluate.tables import main

if __name__ == "__main__":
    sys.exit(main())
