"""benchmarks/ncu_counts.py: reading ncu's CSV output for the ablation table's bank-conflict
columns (the GPU run itself needs ncu and a GPU; the parser does not)."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "ncu_counts.py")
_spec = importlib.util.spec_from_file_location("ncu_counts", _PATH)
ncu_counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_counts)

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def row(metric, unit, value):
    return (f'"0","4242","python3.12","127.0.0.1","void sprnn::persistent_fwd<1, 4>(Params)",'
            f'"1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics",'
            f'"{metric}","{unit}","{value}"')


def test_parses_counts_among_program_output():
    m = ncu_counts.METRICS
    text = "\n".join([
        "==PROF== Connected to process 4242 (/usr/bin/python3.12)",
        "some JAX log line, with a comma",
        "==PROF== Profiling \"persistent_fwd\": 0%....50%....100% - 3 passes",
        HEADER,
        row(m["bank_conflicts"], "", "290,112"),
        row(m["shared_loads"], "inst", "496932"),
        row(m["wavefronts"], "", "918,180"),
        "==PROF== Disconnected from process 4242",
    ])
    assert ncu_counts.parse_ncu_csv(text) == dict(bank_conflicts=290112, wavefronts=918180,
                                                  shared_loads=496932)


def test_a_missing_counter_is_an_error():
    m = ncu_counts.METRICS
    text = "\n".join([HEADER, row(m["bank_conflicts"], "", "1"), row(m["wavefronts"], "", "2")])
    with pytest.raises(ValueError, match="shared_op_ld|shared_ld"):
        ncu_counts.parse_ncu_csv(text)
    with pytest.raises(ValueError):
        ncu_counts.parse_ncu_csv("==ERROR== ERR_NVGPUCTRPERM - no permission")


def test_without_ncu_the_table_gets_a_reason(monkeypatch):
    monkeypatch.setattr(ncu_counts.shutil, "which", lambda name: None)
    assert ncu_counts.shared_counts(3) == {"error": "ncu not found"}
