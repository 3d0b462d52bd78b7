"""Evaluate a model on a task, or score existing responses. See configs/eval.yaml.

python src/eval.py task=text2sql eval.split=spider_dev eval.responses=preds.jsonl eval.output=out
"""

import hydra
from omegaconf import DictConfig

import mrtpo.config  # registers the resolvers the configs use (the run folder's name)
import mrtpo.evaluate_cli  # noqa: F401  (and through mrtpo.cli, the groups --help lists)


@hydra.main(version_base="1.3", config_path="../configs", config_name="eval.yaml")
def main(cfg: DictConfig) -> None:
    from mrtpo.evaluate_cli import main_job

    main_job(cfg)


if __name__ == "__main__":
    main()
