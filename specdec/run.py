"""Command-line entry point: ``python -m specdec.run`` / ``specdec``.

Composes ``conf/run.yaml`` (see :func:`specdec.conf_schema.config_dir` for
where it is found) and calls :func:`specdec.experiment.run_experiment`::

    specdec                                            # built-in target: plain vs every shipped method
    specdec experiment=quick                           # 4 prompts, 16 new tokens
    specdec method=ngram sampling=sample batch_size=4
    specdec target.path=/ckpt/target method=draft_model method.draft_model.path=/ckpt/draft
    specdec data=jsonl data.path=question.jsonl        # e.g. Spec-Bench
    specdec -m method.num_speculative_tokens=1,2,4,8 sampling.temperature=0,0.7
    specdec experiment=gamma_sweep                     # the same sweep, as a preset
    specdec resume_dir=outputs/default/<stamp>_<uid>   # continue an interrupted run
    specdec logger=none | logger.mode=online

How a run ends on stderr, without a traceback: a run that cannot start or
save (a bad key, file or disk, or a run dir another run is writing: ``run dir
'…' is in use by pid N``) prints ``specdec: error: ...`` and exits 2; greedy
outputs of a method that differ from plain decoding's print ``specdec: error:
outputs differ from plain decoding: <method> (request <id>, position <i>) …``
and exit 3, after the results and summary are saved (``allow_mismatch=true``:
a log line, exit 0); Ctrl-C and SIGTERM print ``specdec: interrupted`` and exit
130 / 143. When results were saved, the next line is the command that
continues the run.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from specdec.conf_schema import config_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
# conf/hydra/launcher/submitit_*.yaml set specdec's defaults over the launcher plugin's schema of the
# same name (validated against it, which is what they are for): not a problem to warn about.
warnings.filterwarnings("ignore", message=r"(?s).*hydra/launcher/submitit_\w+' is validated against ConfigStore schema")


def _fail(what: str, e: BaseException, code: int) -> SystemExit:
    """Prints ``specdec: <what>: <e>`` and the exception's notes (the resume hint) to stderr."""
    lines = [f"specdec: {what}" + (f": {e}" if str(e) else ""), *getattr(e, "__notes__", ())]
    print("\n".join(lines), file=sys.stderr, flush=True)
    return SystemExit(code)


@hydra.main(config_path=str(config_dir()), config_name="run", version_base="1.3")
def _main(cfg: DictConfig) -> dict[str, Any]:
    from specdec.conf_schema import ConfigError
    from specdec.core.checkpoint import CheckpointError
    from specdec.data import PromptDataError
    from specdec.experiment import ExperimentError, OutputsDiffer, Terminated, run_experiment

    try:
        return run_experiment(cfg)
    except OutputsDiffer as e:  # all saved: the run is done, its outputs are wrong
        raise _fail("error", e, 3) from None
    except (ConfigError, ExperimentError, PromptDataError, CheckpointError) as e:
        # The message names the key or file: no traceback.
        raise _fail("error", e, 2) from None
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated): the results are saved
        raise _fail("interrupted", e, 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)) from None


def _check_resume_dir(args: Sequence[str]) -> None:
    """A bad ``resume_dir=`` is refused before Hydra makes it its run dir (creating it, or
    writing ``.hydra/`` into, say, a checkpoint dir); so is an existing run dir
    (``resume_dir=`` / ``hydra.run.dir=``) that another run is writing: this process locks it
    first, for its lifetime (rank 0 under torchrun, the one that writes it; a multirun's jobs
    each lock their own)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from specdec.dist.group import env_rank, env_world_size

    parser = OverridesParser.create()
    for arg in args:
        try:
            (o,) = parser.parse_overrides([arg])
        except HydraException:  # a flag (-m, --config-name …) or its value: Hydra's to judge
            continue
        value = o.value()
        if o.key_or_group not in ("resume_dir", "hydra.run.dir") or not isinstance(value, str):
            continue
        from specdec.experiment import ExperimentError, check_resume_dir, hold_run_dir

        try:
            if o.key_or_group == "resume_dir":
                check_resume_dir(Path(value))
            writer = env_world_size() <= 1 or env_rank() == 0
            if writer and Path(value).is_dir() and not {"-m", "--multirun"} & set(args):
                hold_run_dir(Path(value))
        except ExperimentError as e:
            raise _fail("error", e, 2) from None


def _follower_args(args: list[str]) -> list[str]:
    """Under ``torchrun``, a rank other than 0 writes nothing: Hydra's run dir
    for it is a temporary directory (removed at exit) and it logs warnings only;
    rank 0's run dir holds the run (specdec/dist)."""
    from specdec.dist.group import env_rank, env_world_size

    if env_world_size() <= 1 or env_rank() == 0 or {"-m", "--multirun"} & set(args):
        return args
    import atexit
    import logging
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix=f"specdec-rank{env_rank()}-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    logging.getLogger().setLevel(logging.WARNING)
    return [*args, f"hydra.run.dir={tmp}", "hydra.output_subdir=null", "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled", "progress=false"]


def main() -> None:
    """The ``specdec`` console script (arguments: Hydra overrides; ``specdec convert SRC DST``
    converts a pickled checkpoint, :mod:`specdec.convert`)."""
    if sys.argv[1:2] == ["convert"]:
        from specdec.convert import main as convert

        sys.exit(convert(sys.argv[2:]))
    _check_resume_dir(sys.argv[1:])
    sys.argv[1:] = _follower_args(sys.argv[1:])
    try:
        _compose_errors_exit_2(_main)
    finally:
        from specdec.dist import shutdown

        shutdown()


def _compose_errors_exit_2(app: Callable[[], Any]) -> None:
    """Runs the Hydra ``app`` with a config Hydra cannot compose (``foo=1``, a misspelt key, a
    wrong type, an unknown group option, an override it cannot parse) ending as every bad key
    does: ``specdec: error: …`` naming it, exit 2 (Hydra's own report exits 1).

    ``HYDRA_FULL_ERROR=1`` is what makes Hydra raise its errors instead of reporting them (so any
    other exception shows its whole traceback); set by the user, they get Hydra's as asked.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except HydraException as e:
        if before == "1":
            raise
        lines = [ln for ln in str(e).splitlines() if not ln.startswith("To append to your config use +")]
        if isinstance(e.__cause__, OmegaConfBaseException):  # what names the key: "full_key: foo"
            lines.append(str(e.__cause__))
        raise _fail("error", HydraException("\n".join(lines)), 2) from None
    finally:
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


if __name__ == "__main__":
    main()
