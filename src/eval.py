"""Evaluate a model on a task, or score existing responses. See configs/eval.yaml.

python src/eval.py task=text2sql eval.split=spider_dev eval.responses=preds.jsonl eval.output=out
"""

import hydra
from omegaconf import DictConfig

import mrtpo.run.cli  # (registers what --help says of each group)
import mrtpo.run.config  # noqa: F401  (registers the resolvers the configs use)


@hydra.main(version_base="1.3", config_path="../configs", config_name="eval.yaml")
def main(cfg: DictConfig) -> None:
    from mrtpo.evaluate.cli import main_job

    main_job(cfg)


if __name__ == "__main__":
    main()
