"""Optional packages behind some list kinds: imported only when such a list is read, and a clear
error naming the extra to install when one is missing."""
from __future__ import annotations

import importlib
from types import ModuleType

from west.schema import ConfigError

EXTRAS = {"lhotse": "lhotse", "lilcom": "lhotse", "datasets": "datasets"}   # module -> west's extra (setup.py)


def require(module: str, path: str, what: str) -> ModuleType:
    """``module`` imported, or a ConfigError saying that ``path`` (a ``what``) needs its extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = EXTRAS[module]
        raise ConfigError(f"data.data_type: {path} is {what}; reading it needs the optional package {module} "
                          f"({e}): pip install -e '.[{extra}]' in west's checkout "
                          f"(or tools/setup_env.sh {extra})") from None
