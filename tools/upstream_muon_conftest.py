"""conftest for upstream's Muon unit tests on gloo CPU ranks (copied in by
tools/upstream_muon_tests.py as ``tests/unit_tests/conftest.py``, in place of upstream's, which
downloads test data to /opt/data and sets NCCL variables).

* Devices: ``cpu_mode`` redirects megatron-core's CUDA calls where CUDA is absent (as
  pretrain_gpt.py does); on a GPU machine it does nothing and the tests keep NCCL.
* ``Utils.initialize_distributed``: upstream's TCP rendezvous, but gloo on CPU and no
  ``set_device``; each initialization gets its own store prefix, because every test ends with
  the whole process group destroyed (upstream's ``destroy_model_parallel`` drops the groups
  without destroying them: on gloo that leaked ~5,000 threads per rank).
* A layout ``initialize_model_parallel`` cannot form on this many ranks (upstream's own "not
  divisible" check) is a skip naming the ranks it needs, not a failure.
* Where Transformer Engine is absent, a test that builds upstream's TE layer spec is a skip
  naming it (the spec's TE classes are ``None`` there), not a failure.
* Tests that call emerging-optimizers 0.2.0's ``SOAP(precondition_frequency=...)`` themselves
  are skipped, naming why, where the installed SOAP has no such argument (0.3.0; Megatron-LM
  2c8ac9b753 drops it from the same tests): they test the package's API, not the fork.
* ``MEGATRON_UPSTREAM_TESTS_REPORT=DIR``: each rank writes ``DIR/rank<R>.json``
  (test id -> [outcome, reason]) for the launcher's counts.
"""

import itertools
import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron.training import cpu_mode

CPU = cpu_mode.enable_if_needed()

import megatron.core.models.gpt.gpt_layer_specs as _specs  # noqa: E402
import megatron.core.parallel_state as ps  # noqa: E402  (after cpu_mode)
from tests.unit_tests.test_utilities import Utils  # noqa: E402

_INITS = itertools.count()
_STORE = []
_RESULTS = {}


def _base_store():
    if not _STORE:
        _STORE.append(
            dist.TCPStore(
                os.environ.get("MASTER_ADDR", "localhost"),
                int(os.environ.get("MASTER_PORT", "29500")),
                int(os.environ.get("WORLD_SIZE", "1")),
                is_master=False,
                timeout=timedelta(minutes=2),
            )
        )
    return _STORE[0]


def _initialize_distributed():
    if not dist.is_initialized() and Utils.rank >= 0:
        store = dist.PrefixStore(f"upstream_tests_pg_{next(_INITS)}", _base_store())
        backend = "gloo" if CPU else "nccl"
        if not CPU:
            torch.cuda.set_device(Utils.rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            world_size=Utils.world_size,
            rank=Utils.rank,
            store=store,
            timeout=timedelta(minutes=3),
        )
        Utils.store = store
    Utils.inited = True


_upstream_init_mp = ps.initialize_model_parallel


def _initialize_model_parallel(*args, **kwargs):
    try:
        return _upstream_init_mp(*args, **kwargs)
    except RuntimeError as e:
        if "not divisible" not in str(e):
            raise
        pytest.skip(f"layout needs other ranks than {dist.get_world_size()}: {e}")


Utils.initialize_distributed = staticmethod(_initialize_distributed)
ps.initialize_model_parallel = _initialize_model_parallel


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _needs_te(spec_fn, uses_te):
    """``spec_fn`` that skips the test, naming why, where it would build TE modules without TE
    (upstream's TE spec then holds ``None`` classes: "'NoneType' object is not callable")."""

    def wrapped(*args, **kwargs):
        if uses_te(*args, **kwargs):
            pytest.skip(f"needs Transformer Engine (not installed): {spec_fn.__name__}")
        return spec_fn(*args, **kwargs)

    return wrapped


if not _have_transformer_engine():
    _specs.get_gpt_layer_with_transformer_engine_spec = _needs_te(
        _specs.get_gpt_layer_with_transformer_engine_spec, lambda *a, **k: True
    )
    _specs.get_gpt_decoder_block_spec = _needs_te(
        _specs.get_gpt_decoder_block_spec,
        lambda *a, **k: k.get("use_transformer_engine", a[1:2] == (True,)),
    )


# tests of test_emerging_optimizers.py that construct SOAP(precondition_frequency=...) directly
SOAP_0_2_0_API = (
    "test_soap_optimizer_smoke",
    "test_soap_optimizer_multiple_steps",
    "test_soap_optimizer_precondition_frequency",
    "test_soap_optimizer_kl_shampoo",
    "test_soap_optimizer_shampoo_beta",
)


def _soap_takes_precondition_frequency() -> bool:
    import inspect

    from emerging_optimizers.soap import SOAP

    return "precondition_frequency" in inspect.signature(SOAP.__init__).parameters


def pytest_collection_modifyitems(config, items):
    if _soap_takes_precondition_frequency():
        return
    reason = (
        "calls SOAP(precondition_frequency=...) itself: the installed emerging-optimizers "
        "(0.3.0) removed that argument"
    )
    for item in items:
        if item.originalname in SOAP_0_2_0_API:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _fresh_process_group():
    """Every test starts without a process group and leaves none behind (gloo threads)."""
    yield
    if dist.is_initialized():
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    Utils.inited = False


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt():
    """A folder all ranks share (upstream's fixture, without its TempNamedDir on rank 0)."""
    from pathlib import Path

    folder = Path(os.environ["MEGATRON_UPSTREAM_TESTS_TMP"]) / "tmp_dist_ckpt"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = report.longrepr[2]
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            reason = (crash.message if crash else str(report.longrepr)).splitlines()[0][:300]
        if report.nodeid not in _RESULTS or _RESULTS[report.nodeid][0] == "passed":
            _RESULTS[report.nodeid] = [report.outcome, reason]


def pytest_sessionfinish(session, exitstatus):
    folder = os.environ.get("MEGATRON_UPSTREAM_TESTS_REPORT")
    if folder:
        path = os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.json")
        with open(path, "w") as f:
            json.dump(_RESULTS, f, indent=0)
