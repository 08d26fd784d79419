"""The `key=value` command lines of the tools (`hybrid-export`, `hybrid-schedule`): one parser, one wording of
its errors, as Hydra's overrides read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybrid.cli import UsageError

BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def key_values(argv: Sequence[str], keys: Sequence[str], aliases: Mapping[str, str] = {},  # noqa: B006
               hint: str = "") -> dict[str, str]:
    """`key=value` words → {key: value} in the order given (`aliases`: other names of keys). UsageError for a
    word without '=', a key not in `keys` (`hint` follows the list) or one given twice."""
    seen: dict[str, str] = {}
    for word in argv:
        key, sep, value = word.partition("=")
        key = aliases.get(key, key)
        if not sep or not key:
            raise UsageError(f"expected key=value, got {word!r}")
        if key not in keys:
            raise UsageError(f"unknown key {key!r}; expected one of {', '.join(keys)}{hint}")
        if key in seen:
            raise UsageError(f"{key} given twice")
        seen[key] = value
    return seen


def boolean(key: str, value: str) -> bool:
    """true/false (1/0, yes/no, any case); UsageError otherwise."""
    if value.lower() not in BOOLS:
        raise UsageError(f"{key} must be true or false, got {value!r}")
    return BOOLS[value.lower()]
