"""Test setup: 4 host CPU devices (for the sharding tests) and shared fixtures."""

import os

# Must happen before JAX initializes its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import pytest  # noqa: E402


def has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


@pytest.fixture(autouse=True)
def _cpu_only(request):
    """Tests marked cpu_only call the CPU FFI targets directly: run them on the CPU device."""
    if request.node.get_closest_marker("cpu_only") is None:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    import jax_sprnn._ffi as ffi

    if not ffi.CPU_TARGETS:
        pytest.exit("jax_sprnn was imported without its compiled extension (from "
                    f"{ffi.__file__}). Build and install it first: scripts/test.sh does both.",
                    returncode=2)
