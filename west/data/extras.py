"""Optional packages behind some list kinds: imported only when such a list is read, and a clear
error naming the extra to install when one is missing."""
from __future__ import annotations

import importlib
from types import ModuleType

from west.schema import ConfigError

# module -> west's extra (setup.py); None: in no extra (a rarely used storage backend), installed by name
EXTRAS = {"lhotse": "lhotse", "lilcom": "lhotse", "datasets": "datasets", "h5py": None}


def require(module: str, path: str, what: str) -> ModuleType:
    """``module`` imported, or a ConfigError saying that ``path`` (a ``what``) needs its extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = EXTRAS[module]
        how = (f"pip install -e '.[{extra}]' in west's checkout (or tools/setup_env.sh {extra})" if extra
               else f"pip install {module}")
        raise ConfigError(f"data.data_type: {path} is {what}; reading it needs the optional package {module} "
                          f"({e}): {how}") from None
