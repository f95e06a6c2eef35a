"""Run a module from another install of specmesh (a folder made by ``pip install --target``)
instead of this checkout's editable one: ``python scripts/run_site.py SITE MODULE ARGS...``.
The GPU check runs the baseline of a before / after comparison this way, in the same call."""

import runpy
import sys

site, module, *args = sys.argv[1:]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, site)
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
