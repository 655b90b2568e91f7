"""The options of `fastrl train`: every TrainConfig field is a flag (`batch_size` ->
`--batch-size`) whose help text is the field's docstring in fastrl/train/config.py, so the two
never drift apart. TRL's names for the same knobs are aliases (`--num-generations` is
`--group-size`; TRL_ALIASES), TRL's knobs whose meaning differs are refused with what to use
instead (TRL_DIFFERENT), `--config FILE` reads options from a YAML / JSON file (flags override
it), `--opt_name` is read as `--opt-name`, and `--resume` takes the run's own config.json.
`config_from_args` turns the parsed flags into the TrainConfig; fastrl/cli.py is the command.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import sys
import textwrap

from . import config as config_module
from .config import TrainConfig

# options that may differ when resuming (everything else comes from the run's config.json)
RESUME_OVERRIDABLE = (
    "steps",
    "device",
    "dtype",
    "progress",
    "num_threads",
    "save_every",
    "eval_every",
    "reward_timeout",
    "max_time",
    "report_to",
)


# TRL's names (GRPOConfig, transformers TrainingArguments, TRL's scripts) for knobs that mean the
# same here: each is an alias of the fastrl flag, shown next to it in --help, and a key
# `--config` files may use. TRL's knobs whose meaning differs are left out (TRL_DIFFERENT).
TRL_ALIASES = {
    "model": ("model_name_or_path",),
    "group_size": ("num_generations",),
    "lr": ("learning_rate",),
    "lr_schedule": ("lr_scheduler_type",),
    "max_new_tokens": ("max_completion_length",),
    "out": ("output_dir",),
    "epochs": ("num_iterations",),
    "grad_accum": ("gradient_accumulation_steps",),
    "kl_coef": ("beta",),
    "clip_low": ("epsilon",),
    "clip_high": ("epsilon_high",),
    "eval_every": ("eval_steps",),
    "save_every": ("save_steps",),
}

TRL_DIFFERENT = {
    "per_device_train_batch_size": (
        "TRL's per_device_train_batch_size counts completions per device per micro-batch; "
        "fastrl's --batch-size counts prompts per RL step across all ranks, each sampled "
        "--group-size (--num-generations) times, so one RL step trains on batch_size x "
        "group_size completions. Not accepted: use --batch-size (prompts) instead."
    ),
    "max_steps": (
        "TRL's max_steps counts optimizer steps; fastrl's --steps counts RL steps (one rollout "
        "batch each, then --epochs x --minibatches optimizer steps). Not accepted: use --steps."
    ),
    "steps_per_generation": (
        "TRL's steps_per_generation counts micro-batches per rollout batch; fastrl splits each "
        "rollout batch into --minibatches optimizer steps of --grad-accum micro-batches each. "
        "Not accepted: use --minibatches and --grad-accum."
    ),
}

TRL_NOTES = {
    "clip_low": (
        "As in TRL, --epsilon also sets the upper bound unless --epsilon-high / --clip-high is "
        "given; --clip-low sets the lower bound only."
    ),
    "batch_size": "Not TRL's --per-device-train-batch-size (completions per device; see it).",
}


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal after each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(config_module)))
    docs = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            body = node.body
            for a, b in zip(body, body[1:]):
                if (
                    isinstance(a, ast.AnnAssign)
                    and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)
                ):
                    docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def _parse_optional(kind):
    def parse(s: str):
        return None if s.lower() in ("none", "") else kind(s)

    return parse


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


CHOICES = {
    "algo": config_module.ALGOS,
    "loss": config_module.PRESETS,
    "lr_schedule": config_module.LR_SCHEDULES,
    "dtype": config_module.TRAIN_DTYPES,
    "report_to": config_module.REPORT_TO,
    "scale_rewards": config_module.SCALE_REWARDS,
}


def field_kind(f: dataclasses.Field) -> tuple[type, bool]:
    """(bool | int | float | str, whether None is allowed) of a TrainConfig field."""
    ann = str(f.type)
    kind = bool if "bool" in ann else int if "int" in ann else float if "float" in ann else str
    return kind, "None" in ann


def _parser_type(f: dataclasses.Field):
    kind, optional = field_kind(f)
    kind = _bool if kind is bool else kind
    return _parse_optional(kind) if optional else kind


class _Store(argparse.Action):
    """Stores the value like `store`, and which option name gave it (`_names`: dest -> name,
    e.g. `epsilon` for --epsilon), so that a TRL alias can keep TRL's meaning."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        names = dict(getattr(namespace, "_names", {}))
        names[self.dest] = (option_string or "").lstrip("-").replace("-", "_")
        namespace._names = names


class _OneFile(argparse.Action):
    """--config: one file; given twice, an error (argparse would keep the last one alone,
    silently dropping the options of the first)."""

    def __call__(self, parser, namespace, values, option_string=None):
        first = getattr(namespace, self.dest, None)
        if first is not None:
            parser.error(
                f"--config given twice ({first}, {values}): give one file (flags on the command "
                "line override its options)"
            )
        setattr(namespace, self.dest, values)


class _Refuse(argparse.Action):
    """A TRL option whose meaning differs here: an error that says what to use instead."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.help}")


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        action=_OneFile,
        default=argparse.SUPPRESS,
        help="Read options from a YAML (.yaml / .yml) or JSON file: a mapping of option names "
        "(batch_size or batch-size, or their TRL aliases) to values; flags given on the command "
        "line override the file. An unknown key is an error.",
    )
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flags = ["--" + n.replace("_", "-") for n in (f.name, *TRL_ALIASES.get(f.name, ()))]
        extra = {}
        if f.name in CHOICES:  # an optional one takes `none` too (parsed to None first)
            extra = {"choices": (*CHOICES[f.name], *([None] if field_kind(f)[1] else []))}
        if field_kind(f)[0] is bool:  # `--force` alone means true; `--progress false` works too
            extra = {"nargs": "?", "const": True}
        doc = docs.get(f.name, "")
        if f.name in TRL_ALIASES:
            doc += f" ({', '.join(flags[1:])}: TRL's name for it.)"
        if f.name in TRL_NOTES:
            doc += " " + TRL_NOTES[f.name]
        p.add_argument(
            *flags,
            dest=f.name,
            action=_Store,
            type=_parser_type(f),
            default=argparse.SUPPRESS,
            metavar=f.name.upper(),
            help=f"{doc} (default: {f.default})".replace("%", "%%"),
            **extra,
        )
    for name, why in TRL_DIFFERENT.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            action=_Refuse,
            default=argparse.SUPPRESS,
            metavar="N",
            help=why.replace("%", "%%"),
        )


def option_names(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every TrainConfig option of the train parser by name (`batch_size`, `num_generations`)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return {
        s.lstrip("-").replace("-", "_"): a
        for a in parser._actions
        if a.dest in fields
        for s in a.option_strings
    }


def train_args_parser() -> argparse.ArgumentParser:
    """A parser of the `fastrl train` options alone (`add_train_args`)."""
    p = argparse.ArgumentParser(prog="fastrl train")
    add_train_args(p)
    return p


def load_config_file(path: str, options: dict[str, argparse.Action]) -> tuple[dict, dict]:
    """Options from a YAML / JSON file: (value by TrainConfig field, the key that gave it).
    `options`: the train parser's actions by option name (`option_names`). A missing or
    malformed file, an unknown key, two keys for one option or a value of the wrong type raise
    ValueError naming the file (and the key)."""
    import yaml

    where = f"--config {path}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: cannot be read ({e})") from e
    try:
        if path.endswith(".json"):
            data = json.loads(text) if text.strip() else None
        else:  # YAML (JSON is YAML too)
            data = yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON (line {e.lineno}: {e.msg})") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not valid YAML ({' '.join(str(e).split())})") from e
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ValueError(
            f"{where}: expected a mapping of option names to values, got a {type(data).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    values, names = {}, {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        action = options.get(name)
        if action is None and name in TRL_DIFFERENT:  # a TRL knob of another meaning
            raise ValueError(f"{where}: key {key!r}: {TRL_DIFFERENT[name]}")
        if action is None:
            raise ValueError(
                f"{where}: unknown key {key!r} (not a `fastrl train` option; `fastrl train "
                "--help` lists them, e.g. batch_size, group_size, lr)"
            )
        dest = action.dest
        if dest in names:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{where}: keys {names[dest]!r} and {key!r} both set {flag}")
        values[dest] = _file_value(value, fields[dest], action, f"{where}: {key!r}")
        names[dest] = name
    return values, names


_KIND_OK = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _file_value(value, f: dataclasses.Field, action: argparse.Action, where: str):
    """A --config value checked (and converted) like the flag's own: strings go through the
    flag's parser, numbers and booleans must be of the field's kind."""
    kind, optional = field_kind(f)
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
    expected += " or null" if optional else ""
    if value is None:
        if not optional:
            raise ValueError(f"{where}: null is invalid: expected {expected}")
        return None
    if isinstance(value, str):  # as on the command line (`lr: 1e-3` is a string in YAML)
        try:
            value = action.type(value)
        except (ValueError, argparse.ArgumentTypeError):
            raise ValueError(f"{where}: {value!r} is invalid: expected {expected}") from None
    elif not _KIND_OK[kind](value):  # a string field given a number, a list for a number, ...
        raise ValueError(f"{where}: {value!r} is invalid: expected {expected}")
    elif kind is float:
        value = float(value)
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"{where}: {value!r} is invalid: expected one of {choices}")
    return value


def _run_dir_hint(resume: str) -> str:
    """For a --resume path inside a run's checkpoints/ folder (a checkpoint, or its hf/ export):
    the run directory to name instead."""
    parts = os.path.abspath(resume).split(os.sep)
    if "checkpoints" not in parts[1:]:
        return ""
    run = os.sep.join(parts[: len(parts) - 1 - parts[::-1].index("checkpoints")])
    if not os.path.isfile(os.path.join(run, "config.json")):  # a folder named so, not a run's
        return ""
    return f"; --resume takes the run directory (the run's --out), here {run!r}"


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed `fastrl train` arguments: defaults, then the --config file,
    then the flags given; under --resume, the run's config.json with RESUME_OVERRIDABLE ones."""
    given = {k: v for k, v in vars(ns).items() if k not in ("command", "config", "_names")}
    names = dict(getattr(ns, "_names", {}))
    if getattr(ns, "config", None) is not None:
        options = option_names(train_args_parser())
        from_file, file_names = load_config_file(ns.config, options)
        given, names = {**from_file, **given}, {**file_names, **names}
    resume = given.get("resume")
    if resume:
        path = os.path.join(resume, "config.json")
        if not os.path.exists(resume):
            raise ValueError(f"--resume {resume!r} does not exist{_run_dir_hint(resume)}")
        if not os.path.isfile(path):
            raise ValueError(
                f"--resume {resume!r}: no config.json in it (not a fastrl run dir)"
                f"{_run_dir_hint(resume)}"
            )
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"--resume: {path} is not valid JSON ({e})") from e
        if not isinstance(saved, dict):
            raise ValueError(f"--resume: {path} is not a JSON object of TrainConfig options")
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        model = "model_type" in saved or "architectures" in saved  # e.g. a checkpoint's hf/
        if model or not known & saved.keys():
            raise ValueError(
                f"--resume {resume!r}: its config.json is not a fastrl run's ("
                f"{'a model config' if model else 'no fastrl option in it'})"
                f"{_run_dir_hint(resume)}"
            )
        base = {k: v for k, v in saved.items() if k in known}
        # a run from before --scale-rewards: as it ran (dr_grpo's std-scaled advantages; auto is
        # the same for every other loss, and all ppo takes)
        dr_grpo = saved.get("loss") == "dr_grpo" and saved.get("algo") != "ppo"
        base.setdefault("scale_rewards", "group" if dr_grpo else "auto")
        ignored = sorted(
            k
            for k in given
            if k not in RESUME_OVERRIDABLE + ("resume",) and given[k] != base.get(k)
        )
        if ignored:
            print(
                f"--resume: ignoring {', '.join('--' + k.replace('_', '-') for k in ignored)}"
                " (taken from the run's config.json)",
                file=sys.stderr,
            )
        try:  # the saved options alone: an error here is the file's
            TrainConfig(**base).validate()
        except (TypeError, ValueError) as e:
            raise ValueError(f"--resume: {path}: {e}") from e
        base.update({k: v for k, v in given.items() if k in RESUME_OVERRIDABLE})
        base["resume"], base["out"] = resume, resume
        cfg = TrainConfig(**base)
    else:
        # TRL's epsilon is both bounds unless epsilon_high is given
        if names.get("clip_low") == "epsilon" and "clip_high" not in given:
            given["clip_high"] = given["clip_low"]
        cfg = TrainConfig(**given)
    cfg.validate()
    return cfg


def dashes(argv: list[str], train: argparse.ArgumentParser) -> list[str]:
    """`--num_generations 8` (TRL's spelling) read as `--num-generations 8`: an option with
    underscores whose dashed spelling is an option of `train` (the `fastrl train` parser)."""
    known = train._option_string_actions
    out = []
    for a in argv:
        flag, eq, value = a.partition("=")
        if a.startswith("--") and "_" in flag and flag.replace("_", "-") in known:
            a = flag.replace("_", "-") + eq + value
        out.append(a)
    return out
