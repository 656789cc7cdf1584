"""The scripts `nbaccel test` and your own tests run under `nbaccel launch` (Accelerate's
`accelerate.test_utils.scripts`): `test_script` (state, operations, a short training run), `test_ops`
(the distributed operations), `test_sync` (gradient synchronization), `test_cli` (a launch that only
reports the accelerators it sees). Each runs as a file or by `main()`."""

from ..._lazy import lazy_namespace

__getattr__, __dir__ = lazy_namespace(__name__, {})
