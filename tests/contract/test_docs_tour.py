"""The README's main job (benchmarks/tour.py): every op against the materialised reference, nothing dropped
silently, the device and the load stated, the time box spent on extras only."""

import json

import pytest

from benchmarks import tour

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _run(tmp_path, *extra):
    assert tour.main(["--N", "64", "--V", "1009", "--out", str(tmp_path), "--seed", "3", *extra]) == 0
    (path,) = tmp_path.glob("tour-cpu-*.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """One run without a time box, its PNG's texts and its printed lines."""
    import contextlib
    import io

    mpl = pytest.importorskip("matplotlib")
    import matplotlib.figure

    texts = []
    original = matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        texts.extend(t.get_text() for t in fig.texts)
        return original(fig, *args, **kwargs)

    out = tmp_path_factory.mktemp("tour")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setattr(mpl.figure.Figure, "savefig", spy)
        result = _run(out, "--budget-s", "0")
    return result, " ".join(texts).replace("\n", " "), printed.getvalue(), out


def test_every_op_has_the_reference_and_the_default_path_and_is_exact(full):
    result = full[0]
    for op in tour.OPS:
        rows = {r["impl"]: r for r in result["records"] if r["op"] == op}
        assert {"reference", "fusedloss:torch"} <= set(rows), op
        for r in rows.values():
            assert r["max_rel_err"] < 1e-5, (op, r)
            assert r["ms"] is None or r["ms"] > 0
    env = result["env"]
    assert env["device"].startswith("CPU ") and "cores" in env["device"]
    assert env["load_1min_start"] is None or env["load_1min_start"] >= 0
    assert env["default_path"] == "fusedloss:torch"


def test_what_cannot_run_is_listed_with_its_reason(full):
    import torch

    result = full[0]
    skipped = {(s["op"], s["impl"]): s["reason"] for s in result["skipped"]}
    measured = {(r["op"], r["impl"].replace(" (interpreter)", "")) for r in result["records"]}
    for op in tour.OPS:  # every extra of every op is either measured or listed, never absent
        for name, _ in tour.extras_for(op, torch.device("cpu")):
            assert ((op, name) in skipped) != ((op, name) in measured), (op, name)
    why = skipped[("cross_entropy", "fusedloss:cuda")]
    assert "needs a CUDA device" in why or "not built" in why


def test_a_spent_time_box_skips_extras_with_the_reason_never_an_op(tmp_path):
    result = _run(tmp_path, "--budget-s", "1", "--no-plot")
    assert {r["op"] for r in result["records"]} == set(tour.OPS)
    assert {r["impl"] for r in result["records"]} == {"reference", "fusedloss:torch"}
    boxed = [s for s in result["skipped"] if s["reason"].startswith("time box")]
    assert boxed and all("--budget-s 0" in s["reason"] for s in boxed)
    text = tour.table(result)
    assert "not run:" in text and "time box" in text and result["env"]["device"] in text


def test_the_shape_scales_down_with_a_slow_machine_and_stays_at_the_top_on_a_fast_one():
    import torch

    cpu = torch.device("cpu")
    assert tour.plan_shape((0.0, 1e-9), 110, cpu) == (tour.CPU_NS[0], tour.CPU_VS[0], tour.CPU_D)
    slow = tour.plan_shape((50.0, 2e-4), 110, cpu)
    assert slow[0] * slow[1] < tour.CPU_NS[0] * tour.CPU_VS[0]
    # hopeless: the smallest shape, every op still run
    assert tour.plan_shape((1e5, 1.0), 110, cpu) == (tour.CPU_NS[-1], tour.CPU_VS[-1], tour.CPU_D)
    # the memory bound: the largest N x V keeps TRL's ~9 fp32 [N, V] tensors under 600 MiB
    assert 9 * 4 * tour.CPU_NS[0] * tour.CPU_VS[0] < 600 * 2**20


def test_the_png_names_the_device_the_load_and_what_did_not_run(full):
    result, texts, _, out = full
    assert list(out.glob("tour-cpu-*.png"))
    assert result["env"]["device"] in texts
    assert "load" in texts and "not run: fusedloss:cuda" in texts


def test_the_closing_hint_names_the_gpu_command(full):
    printed = full[2]
    assert "on a machine with an NVIDIA GPU: bash tools/install.sh && python benchmarks/tour.py" in printed
    assert "reference" in printed and "max rel err" in printed


def test_a_missing_triton_or_peer_is_listed_with_the_command_that_installs_it(monkeypatch):
    """The user install on a CPU leaves Triton and the peers out: the tour names what to install."""
    import torch

    import fusedloss
    from benchmarks import peers

    status = dict(fusedloss.backend_status(), triton="triton not installed")
    monkeypatch.setattr(fusedloss, "backend_status", lambda: status)
    monkeypatch.setattr(peers, "availability", lambda name, device_type: "not installed")
    why = dict(tour.extras_for("token_logprobs", torch.device("cpu")))
    assert why["fusedloss:triton"].startswith("Triton not installed (pip install triton; then TRITON_INTERPRET=1")
    assert why["trl"] == "not installed (pip install trl)"
