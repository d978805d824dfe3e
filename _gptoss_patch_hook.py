# Interpreter start-up hook of gptoss-patch: ``gptoss_patch.pth`` is the one line ``import _gptoss_patch_hook``.
#
# A top-level module in site-packages (virtualenv's ``_virtualenv.pth`` pattern): this runs in *every* Python process
# on the host, so it imports no package, compiles no string, keeps no other module in its globals and creates no class:
# **this module is the** :data:`sys.meta_path` **finder** (its :func:`find_spec`; importlib asks a finder only for that
# attribute), put first in the list when the module is first imported (once per process: the import system caches it).
# Each choice measured: ``scripts/bench_startup.py``. It waits for the first ``import vllm_ascend``; what happens then
# lives in ``_gptoss_patch_hook_loader`` (the lookup) and :mod:`gptoss_patch._bootstrap` (the activation; its
# ``install()`` is the entry point for ``sitecustomize`` and PEP 829). Rules: standard library only; never raises (a
# failure is one line on stderr, once: :data:`reported`); silent when the ``gptoss_patch`` package is gone (it is looked
# for only when vllm_ascend is first imported). It stays in :data:`sys.meta_path` (removing an entry while importlib
# iterates over the list would skip the next finder): one comparison per import.
#
# With ``vllm_ascend`` already imported (a late import of this module) or ``GPTOSS_PATCH_DISABLE`` /
# ``GPTOSS_PATCH_FORCE`` set (a value to check and report at start-up), :func:`gptoss_patch._bootstrap.late_install`
# does the work; the common start-up reads two keys of the process environment (``posix.environ``, a plain dict).
# Installed whatever the variables say: ``activate()`` records a malformed value as a *refuse* decision and arms the
# GPT-OSS guard, so a typo can never leave GPT-OSS unpatched and unguarded.
#
# (This text is a comment, not the module docstring: a 2 KB docstring is unmarshalled at every interpreter start,
# 3.5 K instructions that scripts/bench_startup.py sees.)


import sys

#: Set once the first lookup of ``vllm_ascend`` was answered (or failed): later lookups pass straight through.
fired = False
#: Set once a failure was reported on stderr (one line per process; the loader and gptoss_patch._bootstrap use it too).
reported = False


def find_spec(fullname, path=None, target=None):
    """importlib's finder protocol: None for every name but the first ``vllm_ascend``, for which it returns the real
    spec with an activating loader (``_gptoss_patch_hook_loader.spec_for``); never raises."""
    global fired, reported
    if fullname != "vllm_ascend" or fired:
        return None
    try:
        # executed from the file beside this one, not imported: this runs under importlib's global lock (an import
        # here could deadlock against a thread importing the same module), and sys.path now starts with the
        # script's or the working directory, where a checkout's copy would shadow the installed file
        # (its .pyc beside it where an image ships bytecode only: the file's suffix picks the loader)
        ext = sys.modules["_frozen_importlib_external"]
        where = ext._path_join(ext._path_split(__file__)[0], "_gptoss_patch_hook_loader.py")
        spec = ext.spec_from_file_location("_gptoss_patch_hook_loader", where if ext._path_isfile(where) else where + "c")
        module = sys.modules["_frozen_importlib"].module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.spec_for(sys.modules[__name__], fullname, path, target)
    except BaseException as exc:  # noqa: BLE001 - must never break the user's import
        fired = True
        if not reported:
            reported = True
            try:
                sys.stderr.write("gptoss-patch: start-up hook failed (%s: %s); GPT-OSS models will be refused on "
                                 "vllm-ascend until this is fixed.\n" % (type(exc).__name__, exc))
            except BaseException:  # noqa: BLE001 - stderr may be closed
                pass
        return None


try:
    if "vllm_ascend" in sys.modules or sys.modules["posix"].environ.get(b"GPTOSS_PATCH_DISABLE") or \
            sys.modules["posix"].environ.get(b"GPTOSS_PATCH_FORCE"):
        import gptoss_patch._bootstrap

        sys.modules["gptoss_patch._bootstrap"].late_install(sys.modules[__name__])
        del gptoss_patch  # keep no package in this module's globals
    else:
        sys.meta_path.insert(0, sys.modules[__name__])
except BaseException as _exc:  # noqa: BLE001 - never break interpreter start-up
    if isinstance(_exc, ImportError) and _exc.name in ("gptoss_patch", "gptoss_patch._bootstrap"):
        reported = True  # the package was removed and this hook left behind: nothing to say in every process
    if not reported:
        reported = True
        try:
            sys.stderr.write("gptoss-patch: start-up hook failed (%s: %s); GPT-OSS models will be refused on "
                             "vllm-ascend until this is fixed.\n" % (type(_exc).__name__, _exc))
        except BaseException:  # noqa: BLE001 - stderr may be closed
            pass
    del _exc
