"""The queue's bench (issue 28), run as `python bench/queue.py [--quick] [--json ...] [--plot ...]`: the code
is bench/pulling.py.

This file has the name of the standard library's `queue`, and a script of bench/ has bench/ first on its
path: one that imports `queue` (through concurrent.futures, say) finds this file. Imported under that
name, it loads the standard library's module in its own place.
"""

import sys

if __name__ == "__main__":
    from pulling import main

    sys.exit(main())
else:  # `import queue` from a script of bench/: the standard library's
    import importlib.util
    import os
    import sysconfig

    _spec = importlib.util.spec_from_file_location(__name__, os.path.join(sysconfig.get_path("stdlib"), "queue.py"))
    assert _spec is not None and _spec.loader is not None
    _stdlib = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_stdlib)
    sys.modules[__name__] = _stdlib
