"""Command-line flags derived from the config dataclasses, so each default exists exactly once.

Every leaf field of a section becomes a flag `--section.path.to.field` (for example
`--model.attention.n_heads 4`, `--train.lr=3e-4`) whose default is "not given"; given flags
override the dataclass (or preset, or YAML) value through `dataclasses.replace`.
"""

import argparse
import json
from pathlib import Path

import yaml

from attnlab.configs import leaf_fields, merge, override


def add_config_flags(parser: argparse.ArgumentParser, sections: dict[str, type]) -> None:
    """Add one `--section.field` flag per leaf field of each section's dataclass."""
    for section, cls in sections.items():
        group = parser.add_argument_group(f"{section} ({cls.__name__} fields)")
        for path, annotation in leaf_fields(cls):
            name = f"{section}.{path}"
            type_name = getattr(annotation, "__name__", str(annotation)).replace("typing.", "")
            group.add_argument(f"--{name}", dest=name, default=None, metavar="V", help=type_name)


def apply_config_flags(configs: dict, args: argparse.Namespace) -> tuple[dict, set[str]]:
    """Apply the given flags to {section: config}; also return the dotted names that were given."""
    given = set()
    for name, value in vars(args).items():
        section, _, path = name.partition(".")
        if value is None or section not in configs or not path:
            continue
        configs[section] = override(configs[section], path, value)
        given.add(name)
    return configs, given


def read_config_file(path: str | Path) -> dict:
    """A YAML or JSON file of `{section: {field: value}}` overrides."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such config file {str(path)!r}")
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(
            f"{str(path)!r} must hold a mapping of sections, got {type(data).__name__}"
        )
    return data


def merge_sections(configs: dict, data: dict) -> dict:
    """Merge {section: {field: value}} into {section: config}; unknown sections are errors."""
    unknown = sorted(set(data) - set(configs))
    if unknown:
        raise ValueError(f"unknown config sections {unknown}; valid: {sorted(configs)}")
    return {k: merge(v, data.get(k, {})) for k, v in configs.items()}
