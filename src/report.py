"""Compare training runs over seeds (the code is mrtpo.evaluate.analysis.report).

python src/report.py logs/train/multiruns/<time>
python src/report.py 'logs/train/multiruns/*' --baseline method=gdpo --out reports/
"""

import sys

from mrtpo.evaluate.analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
