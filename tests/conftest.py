"""Test setup: 4 host CPU devices (for the sharding tests) and shared fixtures."""

import os

# Must happen before JAX initializes its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# scripts/test.sh runs a pytest-xdist worker per core, and on a GPU machine they share the GPU:
# none may take JAX's default 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

# References (Flax's dense cells, jnp.dot) must be exact float32 on GPUs too, where XLA's default
# matmul precision is TF32: seen as 2e-5 differences against Flax's LSTM on the H200.
jax.config.update("jax_default_matmul_precision", "highest")
# Users may turn implicit rank promotion into an error; the library must broadcast explicitly
# (the Flax layers' input bias and the reference's b_hn did not), so every test runs that way.
jax.config.update("jax_numpy_rank_promotion", "raise")


def has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def keep_shard(config, items):
    """SPRNN_TEST_SHARD=k/n keeps every n-th test from the k-th (1-based), so one GPU test run can
    span several device calls (benchmarks/gpu_check.sh verify)."""
    shard = os.environ.get("SPRNN_TEST_SHARD")
    if not shard:
        return
    try:
        k, n = (int(x) for x in shard.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise pytest.UsageError(f"SPRNN_TEST_SHARD={shard!r}: expected k/n with 1 <= k <= n")
    kept, dropped = [], []
    for i, item in enumerate(items):
        (kept if i % n == k - 1 else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_collection_modifyitems(config, items):
    keep_shard(config, items)
    gpu = has_gpu()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    # They call the CPU FFI targets directly; CI (a CPU machine) runs them.
    skip_cpu_only = pytest.mark.skip(reason="direct CPU-handler test; runs where the CPU is "
                                            "JAX's default backend")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        if "cpu_only" in item.keywords and jax.default_backend() != "cpu":
            item.add_marker(skip_cpu_only)


def pytest_configure(config):
    import jax_sprnn._ffi as ffi

    if not ffi.CPU_TARGETS:
        pytest.exit("jax_sprnn was imported without its compiled extension (from "
                    f"{ffi.__file__}). Build and install it first: scripts/test.sh does both.",
                    returncode=2)
