"""Patch records, their structural checks, and applying / removing them through ``wrapt``.

A patch is declared once, in the module of its capability (:mod:`gptoss_patch.patches`), as a
:class:`PatchSpec`: a *target key* (resolved per release by :data:`gptoss_patch.matrix.LAYOUTS`
to ``module:qualname``), a ``wrapt`` wrapper ``(wrapped, instance, args, kwargs)``, the
parameters the target must have, and the modules that import the target *by value* (those
names are rebound too, ``docs/upstream.md`` §7.5).

Two structural checks guard every patch:

* :func:`static_check` reads the target's source with :mod:`ast` *without importing it*, so an
  untested build can be judged before vllm-ascend runs (and its fingerprint compared with the
  tested releases: sha256 of ``ast.get_source_segment`` of the def, ``docs/upstream.md`` §6);
* :meth:`Registry.apply` re-checks the live object (attribute exists, named parameters present)
  when the post-import hook fires, and applies all or nothing for that patch.

Patterns: ``wrapt.resolve_path`` / ``wrapt.apply_patch`` / ``wrapt.FunctionWrapper`` (wrapt
``patches.py``), post-import hooks (wrapt ``importer.py``), one marker per wrapper against double
patching (ddtrace ``contrib/*/patch.py``).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from gptoss_patch.fingerprint import _ast_params, _find_def, _parsed, module_source_path, split_target

PENDING = "pending"
APPLIED = "applied"
SKIPPED = "skipped"
FAILED = "failed"

#: Attribute set on our FunctionWrapper objects; its value is the patch name. The ``_self_`` prefix keeps it on
#: the wrapper: wrapt forwards any other attribute assignment to the wrapped (original) function, which would
#: mark the *original* as patched and survive removal.
MARKER = "_self_gptoss_patch_name"


@dataclass(frozen=True)
class PatchSpec:
    """Declaration of one patch.

    Attributes:
        name: stable name, ``"<capability>.<what>"``, e.g. ``"attention.keep_sinks"``.
        target_key: key into the row's layout (:data:`gptoss_patch.matrix.LAYOUTS`).
        wrapper: ``wrapt`` wrapper ``wrapper(wrapped, instance, args, kwargs) -> result``.
        params: parameter names the target's signature must have; ``"**"`` means it must accept
            ``**kwargs`` (the structural check).
        absent_params: parameter names the target must *not* have (e.g. ``sinks``: a target that
            already takes it is a natively supporting release, not ours to patch).
        rebind_keys: layout keys of modules that bound the target's name by value.
        summary: one line for ``verify``.
        traced: the target (an instance method) is called inside code TorchDynamo traces (vLLM's compiled model
            forward, PIECEWISE graph mode). It is then replaced by a plain Python function calling the wrapper, not
            by a ``wrapt.FunctionWrapper``: Dynamo reads a proxy's forwarded ``__code__``/``__defaults__``, inlines
            the *original* function (skipping the wrapper) and then fails its own guard on the proxy ("Guard failed
            on the same frame it was created"). A plain function is inlined with the wrapper in it.
        defect_present: source fragments the target's ``def`` must contain, and
        defect_absent: fragments it must not contain - the upstream defect the patch fixes, read in the target's
            source (a target whose structure still fits but whose defect is gone - fixed upstream, or a release the
            patch was never meant for - is refused rather than patched).
    """

    name: str
    target_key: str
    wrapper: Callable[..., Any]
    params: tuple[str, ...] = ()
    absent_params: tuple[str, ...] = ()
    defect_present: tuple[str, ...] = ()
    defect_absent: tuple[str, ...] = ()
    rebind_keys: tuple[str, ...] = ()
    summary: str = ""
    traced: bool = False


@dataclass
class PatchState:
    """Per-patch status, as reported by :func:`gptoss_patch.status` and ``verify --json``."""

    name: str
    target: str
    state: str = PENDING
    reason: str = "waiting for the target module to be imported"
    fingerprint: str | None = None  # filled by status() for an applied patch (gptoss_patch.drift.describe)
    drift: str | None = None  # gptoss_patch.drift: "tested code (...)" / "untested code: ..." (status(), lazily)

    def as_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# Static structure (no import)
# ----------------------------------------------------------------------------------------------

def check_params(names: set[str], has_var_kw: bool, spec: PatchSpec) -> list[str]:
    """Problems with a target signature's parameter names against ``spec`` (empty = fine)."""
    problems = []
    for p in spec.params:
        if p == "**":
            if not has_var_kw:
                problems.append("does not accept **kwargs")
        elif p not in names:
            problems.append(f"has no parameter {p!r}")
    for p in spec.absent_params:
        if p in names:
            problems.append(f"already has parameter {p!r} (native support?)")
    return problems


def static_check(spec: PatchSpec, target: str) -> list[str]:
    """Check ``target`` against ``spec`` by reading its source with :mod:`ast`; returns problems (empty = fine).

    Checked: the module and the ``def`` exist, the parameter *names* of ``spec.params`` / ``spec.absent_params``, and
    the defect fragments ``spec.defect_present`` / ``spec.defect_absent`` in the ``def``'s source.
    """
    module, qualname = split_target(target)
    path = module_source_path(module)
    if path is None:
        return [f"{target}: module {module} not found"]
    try:
        _, tree = _parsed(path)
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        return [f"{target}: cannot read {path}: {exc}"]
    node = _find_def(tree, qualname)
    if node is None:
        return [f"{target}: not defined in {path}"]
    if isinstance(node, ast.ClassDef):
        return []
    names, var_kw = _ast_params(node)
    problems = [f"{target} {p}" for p in check_params(names, var_kw, spec)]
    if spec.defect_present or spec.defect_absent:
        source, _ = _parsed(path)
        segment = ast.get_source_segment(source, node) or ""
        problems += [f"{target} no longer contains {frag!r} (the defect this patch fixes; fixed upstream?)"
                     for frag in spec.defect_present if frag not in segment]
        problems += [f"{target} contains {frag!r} (upstream handles it: nothing to patch)"
                     for frag in spec.defect_absent if frag in segment]
    return problems


def runtime_check(spec: PatchSpec, obj: Any) -> list[str]:
    """Check the live target object against ``spec``; returns problems (empty = fine)."""
    if inspect.isclass(obj):
        return []
    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    if not callable(func):
        return [f"is not callable ({type(obj).__name__})"]
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        return [f"has no readable signature ({exc})"]
    names = {p.name for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return check_params(names, var_kw, spec)


# ----------------------------------------------------------------------------------------------
# Applying and removing
# ----------------------------------------------------------------------------------------------

def _plain_method(original: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function standing for the instance method ``original``, calling ``wrapper(bound, self, args, kwargs)``
    as ``wrapt`` would (``bound`` is ``original`` bound to ``self``). See :attr:`PatchSpec.traced`.

    Raises:
        TypeError: ``original`` is not a plain function (a classmethod, staticmethod or builtin cannot be traced-patched).
    """
    import functools
    import types

    if not isinstance(original, types.FunctionType):
        raise TypeError(f"a traced patch needs a plain function as target, got {type(original).__name__}")

    @functools.wraps(original)
    def patched(self, *args, **kwargs):
        return wrapper(original.__get__(self, type(self)), self, args, kwargs)

    return patched


@dataclass
class _Applied:
    parent: Any
    attribute: str
    original: Any
    wrapper: Any
    rebound: list[tuple[Any, str, Any]] = field(default_factory=list)


#: How long a waiter thread (:meth:`Registry.hook`) waits for a module another thread is still importing (s).
DEFERRED_WAIT_S = 600.0

#: Registries holding a target module whose import had not finished when its hook fired (:meth:`Registry.hook`).
_deferring: set = set()
_deferring_lock = threading.Lock()


def still_importing(module: Any) -> bool:
    """True while ``module``'s import has not finished: importlib keeps ``module.__spec__._initializing`` set for the
    whole of its ``exec_module`` (CPython ``Lib/importlib/_bootstrap.py`` ``_load_unlocked``, 3.4 ... 3.13; a
    module is put in ``sys.modules`` before it executes)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


_registration = threading.local()


@contextlib.contextmanager
def registering() -> Iterator[None]:
    """Around ``wrapt.register_post_import_hook`` calls: a hook that ``wrapt`` runs at once from inside (its module
    already in ``sys.modules``) defers a module whose import has not finished (:meth:`Registry.hook`). Per thread."""
    _registration.active = True
    try:
        yield
    finally:
        _registration.active = False


def complete_deferred() -> None:
    """Apply the patches of every registry whose target module was still importing when its hook fired and has
    finished since (:meth:`Registry.complete_deferred`). Called from every post-import hook of ours and by the GPT-OSS
    guard before it judges the patch states; never imports anything."""
    with _deferring_lock:
        registries = list(_deferring)
    for registry in registries:
        registry.complete_deferred()


class Registry:
    """Holds the patches of one activation: their state, and what to undo on :meth:`remove_all`.

    Thread-safe (one re-entrant lock). Never double-wraps: an attribute that already carries our
    marker is left alone and reported as applied.
    """

    def __init__(self, specs: list[PatchSpec], layout: dict[str, str]):
        self._lock = threading.RLock()
        self.specs = {s.name: s for s in specs}
        self.layout = layout
        self.states: dict[str, PatchState] = {}
        self._applied: dict[str, _Applied] = {}
        self._deferred: set[str] = set()
        self._waiter: threading.Thread | None = None
        #: modules whose hook fired at registration while they were still importing (deferred, in order)
        self.deferred_history: list[str] = []
        self.enabled = True
        for s in specs:
            target = layout.get(s.target_key)
            if target is None:
                self.states[s.name] = PatchState(s.name, "-", SKIPPED,
                                                 f"this release has no target {s.target_key!r}")
            else:
                self.states[s.name] = PatchState(s.name, target)

    def target_modules(self) -> dict[str, list[str]]:
        """``{module: [patch names]}`` for the post-import hooks, rebind modules included."""
        out: dict[str, list[str]] = {}
        for name, st in self.states.items():
            if st.state == SKIPPED and st.target == "-":
                continue
            module, _ = split_target(st.target)
            out.setdefault(module, []).append(name)
            for key in self.specs[name].rebind_keys:
                rmod = self.layout.get(key)
                if rmod:
                    out.setdefault(rmod, []).append(name)
        return out

    def hook(self, module: Any) -> None:
        """The post-import hook registered with ``wrapt`` for each of :meth:`target_modules`. Never raises - a hook
        must not break the user's import; a failure is recorded on the module's pending patches.

        ``wrapt`` calls it on two paths. After a module's ``exec_module`` (its finder's chained loader): the module
        is complete, :meth:`on_import` applies. At registration, at once, when the module is already in
        ``sys.modules`` (:func:`registering`): that module may still be executing - in another thread (two threads'
        first imports of vllm-ascend modules, issue 32) or further up this thread's stack - and its target class not
        defined yet. Such a module is *deferred*, not failed: its patches stay pending ("still being imported"), a
        daemon thread waits for the import to finish (polling ``__spec__._initializing``; it imports nothing and
        holds no lock while it waits) and applies them, and :func:`complete_deferred` - run after every hook of ours
        and by the GPT-OSS guard before it judges - applies them if it comes first.
        """
        if getattr(_registration, "active", False) and still_importing(module):
            self._defer(module.__name__)
            return
        self._safe_on_import(module)
        try:
            complete_deferred()
        except Exception:  # noqa: BLE001 - the guard sweeps again before it judges
            pass

    def _safe_on_import(self, module: Any) -> None:
        try:
            self.on_import(module)
        except Exception as exc:  # noqa: BLE001
            with self._lock:
                for st in self.states.values():
                    if st.state == PENDING and st.target.startswith(module.__name__ + ":"):
                        st.state, st.reason = FAILED, f"hook raised {type(exc).__name__}: {exc}"

    def on_import(self, module: Any) -> None:
        """Post-import hook body: apply every pending patch whose target is in ``module``; rebind by-value names."""
        with self._lock:
            if not self.enabled:
                return
            self._deferred.discard(module.__name__)
            for name, st in self.states.items():
                spec = self.specs[name]
                if st.target != "-" and split_target(st.target)[0] == module.__name__ and st.state == PENDING:
                    self._apply(spec, st, module)
                if name in self._applied:
                    self._rebind(spec, self._applied[name], module)

    def _defer(self, name: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            self._deferred.add(name)
            self.deferred_history.append(name)
            for st in self.states.values():
                if st.state == PENDING and st.target.startswith(name + ":"):
                    st.reason = (f"waiting: {name} was still being imported when the hook fired; applied when that "
                                 "import finishes")
            start = self._waiter is None  # cleared by the waiter, under this lock, when it stops
            if start:
                self._waiter = threading.Thread(target=self._wait_deferred, name="gptoss-patch-deferred",
                                                daemon=True)
        with _deferring_lock:
            _deferring.add(self)
        if start:
            self._waiter.start()

    def _wait_deferred(self) -> None:
        """Daemon thread: poll the deferred modules until their imports finish, then apply (:data:`DEFERRED_WAIT_S`
        at most; the guard's :func:`complete_deferred` remains)."""
        import time

        deadline = time.monotonic() + DEFERRED_WAIT_S
        while True:
            with self._lock:
                names = set(self._deferred)
                if not names or time.monotonic() >= deadline:
                    self._waiter = None  # a module deferred from now on starts a new waiter
                    return
            if any(m is None or not still_importing(m) for m in map(sys.modules.get, names)):
                self.complete_deferred()
                continue
            time.sleep(0.002)

    def complete_deferred(self) -> None:
        """Apply the patches of the deferred modules whose import has finished. A module that left ``sys.modules``
        (its import failed) gets a fresh ``wrapt`` post-import hook, so that a later import applies them."""
        with self._lock:
            names = sorted(self._deferred)
        for name in names:
            module = sys.modules.get(name)
            if module is not None and still_importing(module):
                continue
            with self._lock:
                self._deferred.discard(name)
                for st in self.states.values():
                    if st.state == PENDING and st.target.startswith(name + ":"):
                        st.reason = PatchState.reason
            if module is not None:
                self._safe_on_import(module)
            else:
                import wrapt

                wrapt.register_post_import_hook(self.hook, name)
        with self._lock:
            done = not self._deferred
        if done:
            with _deferring_lock:
                _deferring.discard(self)

    def _apply(self, spec: PatchSpec, st: PatchState, module: Any) -> None:
        import wrapt

        _, qualname = split_target(st.target)
        try:
            parent, attribute, original = wrapt.resolve_path(module, qualname)
        except AttributeError as exc:
            st.state, st.reason = FAILED, f"target not found: {exc}"
            return
        if getattr(original, MARKER, None) == spec.name:
            st.state, st.reason = APPLIED, "already wrapped"
            return
        problems = runtime_check(spec, original)
        if problems:
            st.state, st.reason = FAILED, "structural check failed: " + "; ".join(problems)
            return
        wrapper = _plain_method(original, spec.wrapper) if spec.traced else wrapt.FunctionWrapper(original, spec.wrapper)
        setattr(wrapper, MARKER, spec.name)
        try:
            wrapt.apply_patch(parent, attribute, wrapper)
        except Exception as exc:  # noqa: BLE001 - record, never half-apply
            st.state, st.reason = FAILED, f"could not set {st.target}: {exc}"
            return
        applied = self._applied[spec.name] = _Applied(parent, attribute, original, wrapper)
        st.state, st.reason = APPLIED, spec.summary or "applied"
        # a by-value importer whose post-import hook already ran (imported before activation: its hook fired when it
        # was registered, possibly before this one) is rebound now; one still importing is rebound by its own hook
        for key in spec.rebind_keys:
            importer = sys.modules.get(self.layout.get(key) or "")
            if importer is not None:
                self._rebind(spec, applied, importer)

    def _rebind(self, spec: PatchSpec, applied: _Applied, module: Any) -> None:
        for key in spec.rebind_keys:
            if self.layout.get(key) != module.__name__:
                continue
            current = module.__dict__.get(applied.attribute)
            if current is applied.original:
                setattr(module, applied.attribute, applied.wrapper)
            if module.__dict__.get(applied.attribute) is applied.wrapper:  # ours, however it got there: restore it
                entry = (module, applied.attribute, applied.original)
                if entry not in applied.rebound:
                    applied.rebound.append(entry)

    def remove_all(self) -> None:
        """Restore every original object (and rebound names); patches become *skipped* ("deactivated")."""
        with self._lock:
            self.enabled = False
            for name, ap in list(self._applied.items()):
                for mod, attr, orig in ap.rebound:
                    if mod.__dict__.get(attr) is ap.wrapper:
                        setattr(mod, attr, orig)
                if ap.parent.__dict__.get(ap.attribute) is ap.wrapper or getattr(ap.parent, ap.attribute, None) is ap.wrapper:
                    setattr(ap.parent, ap.attribute, ap.original)
                del self._applied[name]
            for st in self.states.values():
                if st.state in (APPLIED, PENDING):
                    st.state, st.reason = SKIPPED, "deactivated"


@dataclass
class Status:
    """What gptoss-patch decided and did in this process (``gptoss_patch.status()``, ``verify --json``).

    Attributes:
        activated: ``activate()`` ran in this process.
        sources: who called it (``"import-hook"`` for the ``.pth``, ``"vllm-plugin"``, ``"api"``, ...).
        decision: ``apply`` / ``stand-down`` / ``refuse``, or None before activation.
        reason: one sentence explaining the decision.
        row: the matrix row (vllm-ascend release) the decision rests on, or None.
        forced: ``GPTOSS_PATCH_FORCE=1`` overrode a refusal.
        versions: installed versions (:class:`gptoss_patch.environment.Versions` as a dict).
        patches: one :class:`PatchState` per patch the row needs.
        gaps: the row's GPT-OSS capabilities that are not native, one line each (patched, deviating, refused).
        details: other facts (``guard``: its state; ``attention_path``: the operator path chosen).
        layout: the module-layout family whose patches are registered (``None`` unless *apply*).
        capabilities: per GPT-OSS capability of the row, ``{"state": ..., "note": ...}``
            (:data:`gptoss_patch.matrix.CAPABILITIES`).
    """

    activated: bool
    sources: list[str]
    decision: str | None
    reason: str
    row: str | None
    forced: bool
    versions: dict
    patches: list[PatchState]
    gaps: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    layout: str | None = None
    capabilities: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the stack is covered: *apply* with every patch applied, or *stand-down*."""
        if self.decision == "stand-down":
            return True
        return self.decision == "apply" and bool(self.patches) and all(p.state == APPLIED for p in self.patches)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d
