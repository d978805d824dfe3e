"""gptoss-patch: run OpenAI GPT-OSS correctly on vllm-ascend 0.11-0.14 without a fork.

Public API (all thread-safe):

* :func:`activate` - decide from the installed versions (see :mod:`gptoss_patch.matrix`) and, on
  *apply*, register the import-time patches. Idempotent. Called automatically by the ``.pth``
  start-up hook on the first ``import vllm_ascend`` and by the ``vllm.general_plugins`` entry point.
* :func:`deactivate` - remove every applied patch (restores the original objects). One-way for the process: a
  later :func:`activate` re-applies nothing, and the GPT-OSS guard stays armed.
* :func:`status` - a :class:`gptoss_patch.registry.Status` record: decision, reason, versions,
  and per patch its target, state and reason.

This module is imported by the start-up hook, so it must stay standard-library-only at import
time; the real work lives in :mod:`gptoss_patch._activation`.
"""

__all__ = ["__version__", "activate", "deactivate", "status"]


def __getattr__(name):
    # __version__ is read lazily: this package is imported at every interpreter start-up.
    if name == "__version__":
        from gptoss_patch._version import __version__

        return __version__
    raise AttributeError(f"module 'gptoss_patch' has no attribute {name!r}")


def activate(source="api", force=None):
    """Decide and, on *apply*, register the GPT-OSS patches. See :func:`gptoss_patch._activation.activate`."""
    from gptoss_patch import _activation

    return _activation.activate(source=source, force=force)


def deactivate():
    """Remove all applied patches, for good in this process. See :func:`gptoss_patch._activation.deactivate`."""
    from gptoss_patch import _activation

    return _activation.deactivate()


def status():
    """Return the current :class:`gptoss_patch.registry.Status`. See :func:`gptoss_patch._state.status`."""
    from gptoss_patch import _state

    return _state.status()
