"""Train a policy with multi-reward RL (or SFT with stage=sft). See configs/train.yaml.

python src/train.py task=ifeval method=mrtpo
python src/train.py -m method=mrtpo method.beta=0.25,0.5,0.75 seed=1,2,3   # GDPO has no beta
"""

import hydra
from omegaconf import DictConfig

import mrtpo.config  # noqa: F401  (registers the resolvers the configs use)


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> float | None:
    from mrtpo.pipeline import train

    metrics = train(cfg)
    # A value Hydra sweepers can optimize: the last mean total reward.
    return metrics.get("train/reward/total/mean")


if __name__ == "__main__":
    import sys

    from mrtpo.settings import ConfigError, check_overrides

    try:  # an unknown rl./optim./replay./data. key: name the valid ones, before Hydra starts
        check_overrides(sys.argv[1:])
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    main()
