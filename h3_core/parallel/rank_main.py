"""The first code a rank worker runs (``workers.spawn_from_pack``), before it reads its job: the pack's package is
registered under the name the starting process imported it by, from its folder, so what that process pickled
(``<package>.h3_core...``) imports here. The package's ``__init__`` imports nothing of a host. Run as a script:
no import of this file's own package precedes it."""

import importlib.util
import os
import sys

_package, _folder = os.environ.get("H3_RANKS_PACKAGE", ""), os.environ.get("H3_RANKS_PACKAGE_FOLDER", "")
if _package and _package not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        _package, os.path.join(_folder, "__init__.py"), submodule_search_locations=[_folder]
    )
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_package] = _module
    _spec.loader.exec_module(_module)
