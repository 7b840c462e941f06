"""Tensor, sequence and context parallelism equal one process: tiny GPT, BERT and T5 split over 2 gloo ranks (tp2;
BERT and T5 also cp2), GPT over 4 (dp2 x tp2, cp2 x tp2), train to one process's losses over 10 steps (relative
1e-5), with its gradients at the first step, its final weights and its validation, on the same global batch. The
cells cover both layouts between the blocks (replicated; sequence-parallel: GPT dp2 x tp2, T5 with its
cross-attention), Muon + muP (GPT tp2) and context parallelism through the whole run (the datamodule's batches cut
by ``SequenceShard``, FSDP2 over dp_shard x cp, composed with TP for GPT). Gradients are clipped below the tiny
models' norms, so the global norm over the mesh is part of what must agree.

Every cell of a world size trains in one launch of ``strategy_worker.py`` (one process for the references, 2 and
4 ranks for the parallel cells).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from training_utils import free_port, metric_by_step, read_metrics, run_cli, run_ranks, tiny_recipe

from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.objectives.loss import token_cross_entropy
from pretrain.parallel.tensor import apply_tensor_parallel, vocabulary_parallel

pytestmark = pytest.mark.slow  # 2- and 4-rank training runs
WORKER = Path(__file__).parents[1] / "strategy_worker.py"
STEPS = 10  # the strategy matrix's length (test_strategies.py): a wrong split shows from the first step
CLIP = 0.5  # below the tiny models' gradient norms: every step clips
TP2 = ["strategy.name=fsdp", "strategy.tensor_parallel=2"]
SP = ["strategy.sequence_parallel=true"]
CP2 = ["strategy.name=fsdp", "strategy.context_parallel=2"]
# Newton-Schulz in float32: in bfloat16 (``auto`` on CPUs with native bf16) a last-bit difference of a gradient moves
# the update by ~1e-2 (``test_muon_sharded.py``), which would hide what is compared
MUON_MUP = [
    "optim.name=muon",
    "optim.muon.ns_dtype=float32",
    "model.parametrization=mup",
    "model.mup_base_width=16",
]
# reference (one process) -> (model kind, overrides); a dp2 cell's reference reads its 2 x 4 samples as one batch
REFERENCES = {
    "gpt-muon-mup": ("gpt", MUON_MUP),
    # without document masks, as these cells ran before data.document_mask: with them gpt-cp2-tp2's step-1 gradients
    # still agree to 5e-7, but 20 AdamW steps drift its weights to 2.9e-5 (packed documents under CP: bert-cp2,
    # t5-cp2 here, test_context_parallel.py)
    "gpt-batch8": ("gpt", ["data.micro_batch_size=8", "data.document_mask=false"]),
    "bert": ("bert", []),
    "t5": ("t5", []),
}
# cell -> (reference, ranks, overrides)
CELLS = {
    "gpt-tp2-muon-mup": ("gpt-muon-mup", 2, TP2 + MUON_MUP),
    "bert-tp2": ("bert", 2, TP2),
    "t5-tp2-sp": ("t5", 2, TP2 + SP),
    "gpt-dp2-tp2-sp": ("gpt-batch8", 4, TP2 + SP + ["data.document_mask=false"]),
    "bert-cp2": ("bert", 2, CP2),
    "t5-cp2": ("t5", 2, CP2),
    "gpt-cp2-tp2": ("gpt-batch8", 4, CP2 + TP2 + ["data.micro_batch_size=8", "data.document_mask=false"]),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_world) -> Path:
    """Every reference and cell trained once (one launch per world size); the directory of their outputs."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    launches: dict[int, list[dict]] = {}
    runs = {name: (kind, 1, overrides) for name, (kind, overrides) in REFERENCES.items()}
    runs |= {name: (REFERENCES[ref][0], ranks, overrides) for name, (ref, ranks, overrides) in CELLS.items()}
    for name, (kind, ranks, overrides) in runs.items():
        directory = root / name
        directory.mkdir()
        recipe = tiny_recipe(
            directory,
            tiny_world,
            kind,
            trainer={
                "devices": ranks,
                "max_steps": STEPS,
                "val_check_interval": STEPS,
                "gradient_clip_val": CLIP,
            },
            checkpoint={"every_n_steps": 100, "save_top_k": 0},
        )
        cell = {"name": name, "recipe": str(recipe), "overrides": overrides, "record": True}
        launches.setdefault(ranks, []).append(cell)
    (root / "out").mkdir()
    for ranks, cells in sorted(launches.items()):
        (root / f"cells{ranks}.json").write_text(json.dumps(cells))
        (root / f"logs{ranks}").mkdir()
        args = (str(root / f"cells{ranks}.json"), str(root / "out"))
        run_ranks(WORKER, *args, world_size=ranks, log_dir=root / f"logs{ranks}")
    return root


def assert_near(ours: torch.Tensor, theirs: torch.Tensor, name: str, rel: float = 1e-5) -> None:
    """||ours - theirs|| <= rel ||theirs||: float32 sums taken in another order (the split matmuls' partial
    sums, all-reduced) differ at rounding level relative to the tensor, not to each element."""
    assert ours.shape == theirs.shape, name
    assert float((ours - theirs).norm()) <= rel * float(theirs.norm()), (name, float((ours - theirs).norm()))


def metrics(root: Path, name: str, key: str) -> dict[int, float]:
    return metric_by_step(read_metrics(root / name / "run"), key)


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
def test_tensor_and_context_parallel_equal_one_process(trained, cell):
    reference = CELLS[cell][0]
    ours, theirs = (metrics(trained, n, "train/loss") for n in (cell, reference))
    assert sorted(theirs) == list(range(1, STEPS + 1)) and sorted(ours) == sorted(theirs)
    worst = max(abs(ours[s] - v) / abs(v) for s, v in theirs.items())
    print(f"{cell}: max relative loss difference to one process over {STEPS} steps {worst:.1e}")
    assert worst <= 1e-5, (ours, theirs)
    norms = metrics(trained, reference, "train/grad_norm")
    assert norms[1] > CLIP  # the first step clips
    assert metrics(trained, cell, "train/grad_norm")[1] == pytest.approx(norms[1], rel=1e-5)
    for key in ("val/loss", "val/accuracy"):
        assert metrics(trained, cell, key) == pytest.approx(metrics(trained, reference, key), rel=1e-5)
    mine, one = (torch.load(trained / "out" / f"{n}.pt", weights_only=True) for n in (cell, reference))
    for what in ("grads", "weights"):
        assert mine[what].keys() == one[what].keys()
        for name, tensor in one[what].items():
            if name.endswith("attn.k.bias"):
                continue  # softmax ignores a key bias: its gradient is rounding, which AdamW scales to lr-sized steps
            assert_near(mine[what][name], tensor, f"{what} {name}")


# ---------------------------------------------------------------------------------------- the plan on the model
LLAMA_GQA = ModelConfig(  # grouped-query attention (2 query heads per key/value head) with QK-norm
    vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=48, max_seq_len=16, norm="rmsnorm",
    norm_bias=False, position="rope", activation="swiglu", qk_norm=True, tie_embeddings=False, init="bert",
    attn_bias=False, mlp_bias=False,
)  # fmt: skip
DROPOUT = dataclasses.replace(LLAMA_GQA, dropout=0.5, attn_dropout=0.5)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(model: Transformer, ids: torch.Tensor, parallel: bool) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Loss, whole gradients and whole logits of one forward + backward on next-token prediction."""
    with vocabulary_parallel(parallel):
        logits = model(ids[:, :-1]).logits
        loss = token_cross_entropy(logits, ids[:, 1:])[0]
        loss.backward()
    grads = {n: _whole(p.grad) for n, p in model.named_parameters()}
    return loss.detach(), grads, _whole(logits.detach())


def _plan_worker(rank: int, port: int, out: dict) -> None:
    """On 2 gloo ranks: the GQA model with and without sequence parallelism against the unsplit model in the same
    process, then the dropout streams of the split one."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        ids = torch.randint(0, 64, (3, 13), generator=torch.Generator().manual_seed(1))
        for sp in (False, True):
            torch.manual_seed(0)
            reference = Transformer(LLAMA_GQA)
            model = copy.deepcopy(reference)
            apply_tensor_parallel(model, mesh, sequence_parallel=sp)
            attn = model.decoder.blocks[0].attn
            heads = [attn.q.weight.to_local().shape[0] // 8, attn.k.weight.to_local().shape[0] // 8]
            meshes = {
                getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) for p in model.parameters()
            }
            result = {"heads": heads, "meshes": meshes}
            result["one"], result["tp"] = _step(reference, ids, False), _step(model, ids, True)
            if rank == 0:
                out[f"sp={sp}"] = result
        # dropout: the same global seed on both ranks, as the training step sets it
        model = Transformer(DROPOUT)
        apply_tensor_parallel(model, mesh, sequence_parallel=True)
        seen: dict[str, list[torch.Tensor]] = {"embed": [], "block": []}
        model.embed.drop.register_forward_hook(lambda m, a, o: seen["embed"].append(o == 0))
        model.decoder.blocks[0].drop.register_forward_hook(lambda m, a, o: seen["block"].append(o == 0))
        masks = []
        for checkpointing in (False, True):  # block 0's dropouts: attention branch, MLP branch (, recomputed)
            model.gradient_checkpointing = checkpointing
            torch.manual_seed(5)
            _step(model.train(), ids, True)
            masks.append({k: list(v) for k, v in seen.items()})
            for v in seen.values():
                v.clear()
        gathered: list = [None, None]
        dist.all_gather_object(gathered, (masks, torch.get_rng_state()))
        if rank == 0:
            out["dropout"] = gathered
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_plan_splits_heads_and_matches_one_process_with_gqa_qk_norm_and_sequence_parallel():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_plan_worker, args=(free_port(), out), nprocs=2, start_method="spawn")
        got = dict(out)
    for sp in (False, True):
        result = got[f"sp={sp}"]
        assert result["heads"] == [2, 1]  # of 4 query and 2 key/value heads, per rank
        assert result["meshes"] == {("tp",)}  # every parameter is a DTensor of the tp mesh
        (loss, grads, logits), (loss_tp, grads_tp, logits_tp) = result["one"], result["tp"]
        assert_near(logits_tp, logits, "logits")
        assert_near(loss_tp, loss, "loss", rel=1e-6)
        assert grads_tp.keys() == grads.keys()
        for name, grad in grads.items():
            assert_near(grads_tp[name], grad, name)
    (masks0, state0), (masks1, state1) = got["dropout"]
    assert torch.equal(state0, state1)  # the shared generator advanced alike on both ranks
    for plain, checkpointed in (masks0, masks1):
        assert len(plain["block"]) == 2 and len(checkpointed["block"]) > 2  # recomputed in the backward
        for key, drawn in plain.items():  # the same masks under activation checkpointing, and when recomputed
            assert all(torch.equal(a, b) for a, b in zip(drawn, checkpointed[key][:2], strict=True))
        assert torch.equal(checkpointed["block"][2], checkpointed["block"][0])
    assert torch.equal(masks0[0]["embed"][0], masks1[0]["embed"][0])  # replicated activations: one mask
    assert not torch.equal(masks0[0]["block"][0], masks1[0]["block"][0])  # a rank's sequence slice: its own


# ------------------------------------------------------------------------------- what reads their checkpoints
def last_checkpoint(root: Path, cell: str) -> Path:
    return root / cell / "run" / "checkpoints" / "last.ckpt"


@pytest.mark.slow
def test_every_cells_checkpoint_holds_its_final_weights(trained):
    """Each TP / CP run's ``last.ckpt`` (DCP shards of DTensors over the dp x cp x tp mesh), read whole in one
    process as validate, export and evaluate read it (``load_model``), holds the run's final weights exactly, and so
    one process's (the cells' weights match their references' to 1e-5 above)."""
    from pretrain.checkpoint import kind, load_model

    for cell in CELLS:
        ckpt = last_checkpoint(trained, cell)
        assert kind(ckpt) == "dcp", cell
        model = load_model(ckpt)[0]
        weights = torch.load(trained / "out" / f"{cell}.pt", weights_only=True)["weights"]
        ours = dict(model.named_parameters())
        assert ours.keys() == weights.keys(), cell
        for name, tensor in weights.items():
            assert torch.equal(ours[name].detach(), tensor), (cell, name)


def validation_metrics(stdout: str) -> dict[str, float]:
    """``{name: value}`` of ``pretrain validate``'s printed ``  val/NAME: VALUE`` lines."""
    rows = (line.strip().split(": ") for line in stdout.splitlines() if line.strip().startswith("val/"))
    return {name: float(value) for name, value in rows}


@pytest.mark.slow
def test_validate_export_and_evaluate_read_a_tp_and_cp_checkpoint(trained, tmp_path, capsys):
    """The cp2 x tp2 GPT run's checkpoint in one process: ``pretrain validate`` gives the run's own last validation
    loss (its one data-parallel rank read the batches one process reads), ``pretrain export`` writes a transformers
    model with our logits, and ``pretrain evaluate`` scores it. ``pretrain validate`` on the run's own mesh (4 gloo
    ranks, cp2 x tp2: each rank reads its shards and its half of every sequence) gives the one-process metrics."""
    import transformers

    from pretrain.checkpoint import load_model
    from pretrain.cli import main

    cell = "gpt-cp2-tp2"
    recipe = next((trained / cell).glob("*.yaml"))
    ckpt = last_checkpoint(trained, cell)
    one = [
        "strategy.name=auto",
        "strategy.tensor_parallel=1",
        "strategy.context_parallel=1",
        "trainer.devices=1",
    ]
    assert main(["validate", str(recipe), "--ckpt", str(ckpt), *CELLS[cell][2], *one]) == 0
    one_process = validation_metrics(capsys.readouterr().out)
    logged = metrics(trained, cell, "val/loss")
    logged = logged[max(logged)]  # the last validation's
    assert one_process["val/loss"] == pytest.approx(logged, rel=1e-4)
    on_mesh = validation_metrics(
        run_cli("validate", str(recipe), "--ckpt", str(ckpt), *CELLS[cell][2]).stdout
    )
    assert on_mesh.keys() == one_process.keys() and "val/accuracy" in on_mesh
    for name, value in one_process.items():  # printed to 4 decimals
        assert on_mesh[name] == pytest.approx(value, abs=1e-4), name

    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = load_model(ckpt)[0]
    ids = torch.arange(5, 25)[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(input_ids=ids).logits, rtol=1e-4, atol=1e-4)

    items = [{"query": "ROMEO:", "choices": [" What", " zzz"], "gold": 0}]
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    task = tmp_path / "tiny.yaml"
    task.write_text(f"name: tiny\ntype: multiple_choice\npath: {tmp_path / 'tiny.jsonl'}\nnum_fewshot: 0\n")
    out = tmp_path / "results.json"
    assert main(["evaluate", str(ckpt), "--tasks", str(task), "--device", "cpu", "--output", str(out)]) == 0
    assert 0.0 <= json.loads(out.read_text())["results"]["tiny"]["metrics"]["acc"] <= 1.0
