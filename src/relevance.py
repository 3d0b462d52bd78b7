"""Look at a run's per-token relevance: each reward's q and w, token by token (mrtpo.evaluate.viewer).

python src/relevance.py logs/train/runs/<run>                 # <run>/relevance.html and .png
python src/relevance.py logs/train/runs/<run> --steps 1,51 --out figures/
"""

import sys

from mrtpo.evaluate.viewer import main

if __name__ == "__main__":
    sys.exit(main())
