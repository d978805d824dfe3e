"""Activate gptoss-patch through ``PYTHONPATH`` where site-packages cannot be written.

Use when the ``.pth`` of the wheel cannot be installed (read-only site-packages, a container
image you do not rebuild)::

    pip install --target /opt/gptoss gptoss-patch          # or a checkout of this repository
    export PYTHONPATH=/opt/gptoss/sitecustomize:/opt/gptoss:$PYTHONPATH

Python imports the first ``sitecustomize`` on ``sys.path`` at start-up (``site`` docs); this one
installs the same lazy start-up hook as ``gptoss_patch.pth`` (idempotent: a no-op if the
``.pth`` already ran) and then runs the next ``sitecustomize`` further on the path, if any, so an
existing site customisation keeps working. It never raises.
"""

import os
import sys


def _gptoss_patch_install():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        try:
            import gptoss_patch._bootstrap as boot
        except ImportError:
            sys.path.append(os.path.dirname(here))  # a checkout: gptoss_patch/ sits next to sitecustomize/
            import gptoss_patch._bootstrap as boot
        boot.install()
    except BaseException as exc:  # noqa: BLE001 - never break start-up
        sys.stderr.write("gptoss-patch: sitecustomize activation failed (%s: %s)\n" % (type(exc).__name__, exc))
    # chain to the next sitecustomize on the path
    try:
        import importlib.machinery
        import importlib.util

        rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is not None and spec.origin and os.path.abspath(spec.origin) != os.path.abspath(__file__):
            module = importlib.util.module_from_spec(spec)
            sys.modules["_gptoss_patch_chained_sitecustomize"] = module
            spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001
        sys.stderr.write("gptoss-patch: the chained sitecustomize failed (%s: %s)\n" % (type(exc).__name__, exc))


_gptoss_patch_install()
del _gptoss_patch_install
