"""Export a training checkpoint as a Hugging Face model folder. See configs/export.yaml.

python src/export.py ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt out=exported/
"""

import sys

import hydra
from omegaconf import DictConfig

import mrtpo.run.config  # noqa: F401  (registers the resolvers the configs use)


@hydra.main(version_base="1.3", config_path="../configs", config_name="export.yaml")
def main(cfg: DictConfig) -> None:
    from mrtpo.evaluate.export import run

    try:
        run(cfg)
    except ValueError as exc:  # bad input: one line naming the key, not a traceback
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
