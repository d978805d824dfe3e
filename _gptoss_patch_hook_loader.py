"""The first lookup of ``vllm_ascend`` (``_gptoss_patch_hook.find_spec``): the real spec, its loader
wrapped so that gptoss-patch activates before any vllm-ascend code runs.

Executed by that finder from the file beside the hook (not imported: no module lock, no ``sys.path`` search), while
importlib holds its global import lock (``_ImportLockContext`` around each ``find_spec`` in
``importlib._bootstrap._find_spec``). Activation itself must not run under that lock (it deadlocked against a thread whose first ``gptoss_patch.activate()`` was importing
``gptoss_patch._activation``: it held that module's lock and waited for the global one), so it runs in the wrapped
loader's ``exec_module`` (:func:`gptoss_patch._bootstrap.exec_module`), under vllm_ascend's own module lock only.
Standard library only.
"""

import sys


class _ActivatingLoader:
    """Wraps the real loader of ``vllm_ascend``: ``exec_module`` activates gptoss-patch, then delegates; other
    attributes (``get_code``, ``get_resource_reader``, ...) are the real loader's."""

    def __init__(self, finder, loader):
        self._finder, self._loader = finder, loader

    def create_module(self, spec):  # noqa: D102 - importlib protocol
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):  # noqa: D102 - importlib protocol
        try:
            boot = _bootstrap()
        except BaseException as exc:  # noqa: BLE001 - never break the user's import: say so once, import it anyway
            self._finder.fired = True
            if isinstance(exc, ImportError) and exc.name in ("gptoss_patch", "gptoss_patch._bootstrap"):
                self._finder.reported = True  # the package was removed, this hook left behind: stay silent
            if not self._finder.reported:
                self._finder.reported = True
                sys.stderr.write("gptoss-patch: start-up hook failed (%s: %s); GPT-OSS models will be refused on "
                                 "vllm-ascend until this is fixed.\n" % (type(exc).__name__, exc))
            self._loader.exec_module(module)
            return
        boot.exec_module(self, module)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_loader", "_finder"):
            raise AttributeError(name)
        return getattr(self._loader, name)


def _bootstrap():
    """``gptoss_patch._bootstrap``, from the gptoss-patch installed beside this hook.

    The package is first imported here, when ``sys.path`` starts with the script's directory or the working
    directory: a ``gptoss_patch/`` folder there (a checkout, a copy) would shadow the installed package. When it
    would, the installed one is imported instead (its directory put first in ``sys.path`` for that one import).

    Raises:
        ModuleNotFoundError: (``name`` ``"gptoss_patch"``) no gptoss-patch package is installed beside the hook (it
            was removed and the hook left behind, or only a stray directory is left): the caller stays silent.
    """
    import importlib.machinery
    import os

    if "gptoss_patch" not in sys.modules:
        here = os.path.dirname(os.path.abspath(__file__))
        installed = importlib.machinery.PathFinder.find_spec("gptoss_patch", [here])
        if getattr(installed, "origin", None) in (None, "namespace"):
            raise ModuleNotFoundError("no gptoss_patch package beside its start-up hook", name="gptoss_patch")
        found = importlib.machinery.PathFinder.find_spec("gptoss_patch")
        if getattr(found, "origin", None) != installed.origin:
            sys.path.insert(0, here)
            try:
                import gptoss_patch  # noqa: F401 - the installed one
            finally:
                sys.path.remove(here)
    import gptoss_patch._bootstrap as boot

    return boot


def spec_for(finder, fullname, path, target):
    """The spec the finders after ``finder`` (the ``_gptoss_patch_hook`` module) in :data:`sys.meta_path` give for ``fullname``, with its loader wrapped
    in :class:`_ActivatingLoader`; None when none finds it (importlib reports it) or it has no loader (a namespace
    portion). A legacy loader without ``exec_module`` is left alone and activation waits for the plugin entry point.
    Raises whatever a later finder raises (the caller reports it once and lets the import go on)."""
    after, spec = False, None
    for other in list(sys.meta_path):
        if other is finder:
            after = True
        elif after and getattr(other, "find_spec", None) is not None:
            spec = other.find_spec(fullname, path, target)
            if spec is not None:
                break
    loader = getattr(spec, "loader", None)
    if loader is None:
        return None
    if not hasattr(loader, "exec_module"):
        finder.fired = True
        return None
    spec.loader = _ActivatingLoader(finder, loader)
    return spec
