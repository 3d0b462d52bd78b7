"""Train a policy with multi-reward RL (or SFT with stage=sft). See configs/train.yaml.

python src/train.py task=ifeval method=mrtpo
python src/train.py -m method=mrtpo method.beta=0.25,0.5,0.75 seed=1,2,3   # GDPO has no beta
python src/train.py experiment=text2sql_coder7b --check   # check it all, say what it would do
"""

import hydra
from omegaconf import DictConfig

import mrtpo.run.cli  # (registers what --help says of each group)
import mrtpo.run.config  # (registers the resolvers the configs use)


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> float | None:
    from mrtpo.lightning.pipeline import train
    from mrtpo.run.cli import in_sweep, run_job
    from mrtpo.run.folder import discard_refused_folder, is_refusal
    from mrtpo.run.resume import NothingToTrain

    if cfg.get("dry_run"):  # --check: every check, then what the run would do; no training
        from mrtpo.run.dryrun import dry_run

        try:
            run_job(dry_run, cfg)
        finally:
            discard_refused_folder(cfg)
        return None
    raised: list[BaseException] = []

    def job(c: DictConfig):
        try:
            return train(c)
        except BaseException as exc:  # (a refusal's new folder goes, below)
            raised.append(exc)
            raise

    try:  # a bad value, missing data or a model that cannot load: its message alone, exit 2
        metrics = run_job(job, cfg)
    except NothingToTrain as done:  # +resume of a finished run: said, nothing changed
        print(done, flush=True)
        if in_sweep():
            return None
        raise SystemExit(0) from None  # (a return would record the no-op in job.json)
    except BaseException:
        if raised and is_refusal(raised[0]):
            discard_refused_folder(cfg)  # refused before it trained: its new folder goes
        raise
    # A value Hydra sweepers can optimize: the last mean total reward.
    return metrics.get("train/reward/total/mean")


if __name__ == "__main__":
    import sys

    from mrtpo.run.config_keys import check_overrides
    from mrtpo.run.resume import resume_overrides
    from mrtpo.run.settings import ConfigError
    from mrtpo.run.signals import run_and_exit

    mrtpo.run.cli.COMMAND_LINE = True  # a refusal as Hydra starts: one line, exit status 2
    # --check is dry_run=true (configs/train.yaml), for Hydra
    sys.argv = ["dry_run=true" if a == "--check" else a for a in sys.argv]
    try:  # an unknown rl./optim./replay./data. key: name the valid ones, before Hydra starts
        check_overrides(sys.argv[1:])
        # +resume=<run>: the run's own overrides (its .hydra/overrides.yaml), then what a
        # resume may change; any other key given is refused naming the run's value
        sys.argv[1:] = resume_overrides(sys.argv[1:])
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    # SIGTERM/SIGINT end the run within a bounded time (exit status 143/130), and threads a
    # reward left running do not keep the process alive after the run (mrtpo.core.faults)
    run_and_exit(main)
