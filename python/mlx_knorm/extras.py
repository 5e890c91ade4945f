"""How to install an optional extra. mlx-knorm is installed from a clone
(or a release wheel), not from PyPI, so a hint names the extra's own
packages, read from this installation's metadata (pyproject.toml, the one
source), and the extra for a clone."""

from __future__ import annotations

import re
from importlib import metadata


def extra_requirements(extra: str) -> list[str]:
    """The requirements the extra ``extra`` adds, as pyproject.toml lists them."""
    try:
        requirements = metadata.requires("mlx-knorm") or []
    except metadata.PackageNotFoundError:
        return []
    marker = f'extra == "{extra}"'
    found = []
    for requirement in requirements:
        if marker not in requirement.replace("'", '"'):
            continue
        name = requirement.split(";", 1)[0].strip()
        # An extra that names another of this package's extras: its requirements.
        included = re.fullmatch(r"mlx-knorm\[(\w+)\]", name)
        for r in extra_requirements(included.group(1)) if included else [name]:
            if r not in found:
                found.append(r)
    return found


def install_hint(extra: str) -> str:
    """``pip install 'mlx-lm<0.33,>=0.32' (in a clone of mlx-knorm: pip install '.[lm]')``."""
    packages = " ".join(f"'{r}'" for r in extra_requirements(extra))
    clone = f"pip install '.[{extra}]'"
    return f"pip install {packages} (in a clone of mlx-knorm: {clone})" if packages else clone
