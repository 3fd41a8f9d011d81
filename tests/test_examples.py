"""The pruned-LM example pipeline (smallest config) and checkpoint round trips."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import charlm  # noqa: E402
import pruned_lm  # noqa: E402
import quickstart  # noqa: E402
import train_prune_lm  # noqa: E402

from jax_sprnn import pruning  # noqa: E402
from jax_sprnn.flax.nnx import SparseLSTM  # noqa: E402


def test_tiny_pipeline_end_to_end(tmp_path):
    cfg = charlm.CONFIGS["tiny"]
    trained = tmp_path / "trained"
    train_prune_lm.run(cfg, str(trained), quiet=True)
    # Evaluation finds the checkpoints after the workdir moved (e.g. trained on a CPU, copied
    # to a GPU machine): the summary lists them relative to it.
    moved = trained.rename(tmp_path / "moved")
    rows = pruned_lm.main(["--config", "tiny", "--workdir", str(moved), "--quiet",
                           "--skip-training"])
    assert [r["density"] for r in rows] == list(cfg.densities)
    for r in rows:
        assert r["agree"], r
        assert abs(r["bpc_dense_flax"] - r["bpc_sparse"]) < 1e-3
        assert 0.5 < r["bpc_sparse"] < 8.0  # better than uniform over bytes (8 bits)
        assert r["sparse_us_per_step"] > 0
    nnz = [r["recurrent_nnz"] for r in rows]
    assert nnz[0] == 4 * cfg.hidden ** 2 * cfg.layers and nnz == sorted(nnz, reverse=True)
    assert (moved / "pruned_lm.png").stat().st_size > 10_000
    table = (moved / "results.md").read_text()
    assert "bpc (jax_sprnn sparse)" in table and table.count("\n| ") == 1 + len(rows)
    saved = json.loads((moved / "results.json").read_text())
    assert saved["rows"] == rows
    # Checkpoints hold exactly the saved pattern.
    for entry in json.loads((moved / "train_summary.json").read_text())["checkpoints"]:
        params, masks = charlm.load_checkpoint(charlm.listed_checkpoint(moved, entry))
        assert pruning.density_report(masks) == pytest.approx(pruning.density_report(params))
        for m in charlm.layer_masks(cfg, masks):
            assert m.density == pytest.approx(entry["density"], abs=0.01)


def test_quickstart_more_sequences_than_steps_and_bad_arguments(capsys):
    # Batch 8 over 12 steps gives the ragged lengths 12, 9, ..., 0, 0 (they went negative).
    quickstart.main(["--hidden", "16", "--batch", "8", "--steps", "12"])
    assert "agreement" in capsys.readouterr().out
    for bad in (["--hidden", "0"], ["--density", "1.5"]):
        with pytest.raises(SystemExit):
            quickstart.main(bad)
    assert "must" in capsys.readouterr().err


def test_evaluation_without_training_says_what_to_run(tmp_path):
    with pytest.raises(SystemExit, match="train first"):
        pruned_lm.main(["--config", "tiny", "--workdir", str(tmp_path), "--skip-training"])


def test_evaluation_of_another_config_or_no_checkpoints_says_why(tmp_path):
    charlm.write_json(tmp_path / "train_summary.json", {"config": "cpu", "checkpoints": []})
    with pytest.raises(SystemExit, match="trained with --config cpu, not tiny"):
        pruned_lm.main(["--config", "tiny", "--workdir", str(tmp_path), "--skip-training"])
    charlm.write_json(tmp_path / "train_summary.json", {"config": "tiny", "checkpoints": []})
    with pytest.raises(SystemExit, match="lists no checkpoints"):
        pruned_lm.main(["--config", "tiny", "--workdir", str(tmp_path), "--skip-training"])
    listed = {"density": 0.3, "path": "checkpoints/density_0.300"}
    charlm.write_json(tmp_path / "train_summary.json", {"config": "tiny", "checkpoints": [listed]})
    with pytest.raises(SystemExit, match="density_0.300 .density 30%.*is missing"):
        pruned_lm.main(["--config", "tiny", "--workdir", str(tmp_path), "--skip-training"])


def test_linen_checkpoint_round_trip(tmp_path):
    cfg = charlm.CONFIGS["tiny"]
    model = charlm.make_model(cfg)
    tokens = jnp.asarray(np.arange(2 * 9).reshape(2, 9) % 256, jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    pruned, masks = pruning.prune(params, 0.2)
    path = charlm.save_checkpoint(tmp_path, 0.2, pruned, masks)
    params2, masks2 = charlm.load_checkpoint(path)
    for a, b in zip(jax.tree_util.tree_leaves(pruned), jax.tree_util.tree_leaves(params2)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree_util.tree_leaves(masks), jax.tree_util.tree_leaves(masks2)):
        assert b.dtype == np.bool_
        np.testing.assert_array_equal(a, b)
    sparse = charlm.make_model(cfg, charlm.layer_masks(cfg, masks2))
    logits, _ = sparse.apply({"params": params2}, tokens)
    ref, _ = model.apply({"params": pruned}, tokens)
    np.testing.assert_allclose(logits, ref, atol=1e-5)


def test_nnx_checkpoint_round_trip(tmp_path):
    import orbax.checkpoint as ocp

    layer = SparseLSTM(5, 8, density=0.3, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 5))
    expected = layer(x)
    graphdef, state = nnx.split(layer)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "layer", state)
    fresh = SparseLSTM(5, 8, density=0.3, rngs=nnx.Rngs(42))  # same pattern, other values
    graphdef2, abstract = nnx.split(nnx.eval_shape(lambda: fresh))
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(tmp_path / "layer", abstract)
    np.testing.assert_allclose(nnx.merge(graphdef2, restored)(x), expected, atol=1e-6)
    assert graphdef2 == graphdef  # the static mask is part of the graph definition
