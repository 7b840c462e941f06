"""PretrainModule: the gradient of an accumulated step equals the whole global batch's; logged metrics; precisions."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from training_utils import metric_by_step, read_metrics, tiny_recipe

from pretrain import config
from pretrain.models.transformer import Transformer
from pretrain.training.module import STEP_TARGETS, TARGET_POSITIONS, PretrainData, StepGroups
from pretrain.training.setup import build_data, prepare_run
from pretrain.training.trainer import build_trainer


class CaptureGrads(Callback):
    """Gradients of the first optimizer step, as the optimizer would see them (before clipping)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.grads:
            self.grads = {
                n: p.grad.clone() for n, p in pl_module.model.named_parameters() if p.grad is not None
            }


def fit_one_step(tmp_path, world, kind: str, micro: int, k: int):
    recipe = tiny_recipe(
        tmp_path,
        world,
        kind,
        data={"micro_batch_size": micro},
        trainer={"max_steps": 1, "accumulate_grad_batches": k, "gradient_clip_val": None},
    )
    run, resolved = config.load(recipe)
    parts = prepare_run(run, resolved)
    init = copy.deepcopy(parts.module.model.state_dict())
    capture = CaptureGrads()
    trainer = build_trainer(run, resolved, callbacks=[capture], loggers=[])
    trainer.fit(parts.module, datamodule=parts.datamodule)
    return run, parts, init, capture.grads


def one_piece_grads(run, parts, init, global_batch: int, loss_fn) -> dict[str, torch.Tensor]:
    """Gradients of ``loss_fn(model, [micro-batches])`` on the run's first ``global_batch`` samples."""
    run.data.micro_batch_size, run.trainer.accumulate_grad_batches = global_batch, 1
    dm = build_data(run, parts.module.objective, parts.tokenizer)
    batch = next(iter(dm.train_dataloader()))
    batch.pop(STEP_TARGETS)
    model = Transformer(run.model)
    model.load_state_dict(init)
    loss_fn(model, batch).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def global_mean_loss(objective):
    def fn(model, batch):
        labels = batch.pop("labels")
        loss_sum, n = objective.loss(model(**batch).logits, labels)
        return loss_sum / n

    return fn


def mean_of_micro_means(objective, micro: int):
    def fn(model, batch):
        labels = batch.pop("labels")
        losses = []
        for i in range(0, labels.shape[0], micro):
            part = {k: v[i : i + micro] for k, v in batch.items()}
            loss_sum, n = objective.loss(model(**part).logits, labels[i : i + micro])
            losses.append(loss_sum / n)
        return torch.stack(losses).mean()

    return fn


@pytest.mark.parametrize("kind", ["gpt", "bert", "t5"])
def test_accumulated_gradient_equals_global_batch_gradient(tmp_path, tiny_world, kind):
    """2 micro-batches of 2 (accumulated by the Trainer) == 1 batch of 4: sum of token losses / total targets."""
    run, parts, init, grads = fit_one_step(tmp_path, tiny_world, kind, micro=2, k=2)
    objective = parts.module.objective
    reference = one_piece_grads(run, parts, init, 4, global_mean_loss(objective))
    assert grads.keys() == reference.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-4, atol=1e-6, msg=name)
    if kind == "bert":  # MLM masks a varying number of tokens per micro-batch: a mean of means differs
        naive = one_piece_grads(run, parts, init, 4, mean_of_micro_means(objective, 2))
        assert any(not torch.allclose(grads[n], naive[n], rtol=1e-3, atol=1e-6) for n in grads)


class GradientsHeld(Callback):
    """Whether any parameter holds a gradient before each micro-batch's forward and after each batch."""

    def __init__(self) -> None:
        self.before: list[bool] = []
        self.after: list[bool] = []

    @staticmethod
    def _held(pl_module) -> bool:
        return any(p.grad is not None for p in pl_module.parameters())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before.append(self._held(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after.append(self._held(pl_module))


def test_gradients_are_freed_right_after_each_update(tmp_path, tiny_world):
    """As in a plain loop: no gradient lives through a step's first forward (Lightning's own order frees them
    only before the next backward); within an accumulated step they are kept, and the first step's gradient
    still equals the global batch's (test above)."""
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", trainer={"max_steps": 3, "accumulate_grad_batches": 2})
    run, resolved = config.load(recipe)
    parts = prepare_run(run, resolved)
    held = GradientsHeld()
    trainer = build_trainer(run, resolved, callbacks=[held], loggers=[])
    trainer.fit(parts.module, datamodule=parts.datamodule)
    assert held.before == [False, True] * 3  # micro-batch 1 of each step adds to micro-batch 0's gradients
    assert held.after == [True, False] * 3


def test_step_groups_tag_each_micro_batch_with_its_step_target_count():
    batches = [
        {"labels": torch.tensor([[1, -100, 3]])},
        {"labels": torch.tensor([[-100, -100, 2]])},
        {"labels": torch.tensor([[4, 5, 6]])},
        {"labels": torch.tensor([[7, -100, -100]])},
        {"labels": torch.tensor([[8, 8, 8]])},
    ]
    groups = StepGroups(batches, 2)
    out = list(groups)
    assert len(groups) == len(out) == 4  # the trailing incomplete step is dropped
    assert [int(b[STEP_TARGETS]) for b in out] == [3, 3, 4, 4]


def test_an_epochs_trailing_incomplete_step_is_skipped_by_the_data_position(tmp_path, tiny_world):
    """5 batches per epoch, 2 per step: the position rolls over after the 4th, so the next ``iter()`` (a new
    epoch for the loop) starts the data's next epoch instead of an empty rest of this one."""
    run, resolved = config.load(tiny_recipe(tmp_path, tiny_world, "gpt"))
    objective = prepare_run(run, resolved).datamodule.objective
    dm = PretrainData(
        tiny_world["data"],
        objective,
        seq_len=32,
        micro_batch_size=4,
        samples_per_epoch=20,
        accumulate_grad_batches=2,
    )
    assert dm.batches_per_epoch == 4
    epochs = []
    for _ in range(2):
        epochs.append(list(dm.train_dataloader()))
        assert len(epochs[-1]) == 4
        dm.advance(len(epochs[-1]))
    assert dm.state_dict()["epoch"] == 2 and dm.state_dict()["consumed_samples"] == 0
    assert not torch.equal(epochs[0][0]["input_ids"], epochs[1][0]["input_ids"])  # another permutation


def test_masks_that_mask_nothing_are_dropped_before_transfer(tmp_path, tiny_world):
    run, resolved = config.load(tiny_recipe(tmp_path, tiny_world, "t5"))
    parts = prepare_run(run, resolved)
    batch = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "attention_mask": torch.ones(2, 3),
        "decoder_attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
    }
    out = parts.datamodule.on_before_batch_transfer(dict(batch), 0)
    assert "attention_mask" not in out and out["decoder_attention_mask"] is batch["decoder_attention_mask"]
    one_each = {"document_ids": torch.tensor([[0, 0, -1]]), "position_ids": torch.tensor([[0, 1, 0]])}
    out = parts.datamodule.on_before_batch_transfer({**batch, **one_each}, 0)
    assert "document_ids" not in out and "position_ids" not in out  # one document per row: nothing to mask
    packed = {"document_ids": torch.tensor([[0, 1, 1]]), "position_ids": torch.tensor([[0, 0, 1]])}
    assert parts.datamodule.on_before_batch_transfer({**batch, **packed}, 0).keys() >= packed.keys()
    # the tiny recipes keep documents apart (data.document_mask defaults on): batches of several carry their ids
    dm = parts.datamodule
    dm.setup("fit")
    first = dm.on_before_batch_transfer(next(iter(dm.train_dataloader())), 0)
    assert first["document_ids"].max() > 0 and first["decoder_document_ids"].max() > 0


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_sparse_targets_get_target_positions_before_transfer(tmp_path, tiny_world, kind):
    """MLM batches carry the flat indices of their labelled positions (the LM head runs there only; the gathered
    training gradient is checked against the all-positions one above); causal LM targets are dense."""
    run, resolved = config.load(tiny_recipe(tmp_path, tiny_world, kind))
    parts = prepare_run(run, resolved)
    dm, module = parts.datamodule, parts.module
    dm.setup("fit")
    batch = dm.on_before_batch_transfer(next(iter(dm.train_dataloader())), 0)
    inputs, labels = module._split(batch)
    if kind == "gpt":
        assert TARGET_POSITIONS not in batch and labels is batch["labels"]
        return
    positions = batch[TARGET_POSITIONS]
    assert torch.equal(labels, batch["labels"][batch["labels"] != -100])
    assert 0 < len(positions) < batch["labels"].numel() / 2
    logits = module.model(**inputs).logits
    assert logits.shape == (len(positions), run.model.vocab_size)
    full = module.model.flops_per_token(32) * 32 * inputs["input_ids"].shape[0]
    head = 6 * (32 * 32 + 32 * run.model.vocab_size)  # MLM transform + decoder weights, per position
    assert module._batch_flops(inputs, backward=True) == pytest.approx(
        full - head * (inputs["input_ids"].numel() - len(positions))
    )


def test_logged_metrics(tmp_path, tiny_world):
    recipe = tiny_recipe(
        tmp_path,
        tiny_world,
        "gpt",
        trainer={
            "max_steps": 6,
            "accumulate_grad_batches": 2,
            "val_check_interval": 3,
            "throughput_window": 2,
            "peak_flops": 1e12,
        },
    )
    run, resolved = config.load(recipe)
    parts = prepare_run(run, resolved)
    trainer = build_trainer(run, resolved)
    trainer.fit(parts.module, datamodule=parts.datamodule)
    rows = read_metrics(tmp_path / "run")
    loss = metric_by_step(rows, "train/loss")
    assert sorted(loss) == list(range(1, 7))  # the k-th optimizer step at step k
    for step, value in metric_by_step(rows, "train/perplexity").items():
        assert value == pytest.approx(math.exp(loss[step]), rel=1e-4)
    tokens_per_step = 4 * 2 * 32  # micro-batch x accumulation x seq_len
    assert metric_by_step(rows, "train/tokens_seen") == {s: float(s * tokens_per_step) for s in range(1, 7)}
    lr = metric_by_step(rows, "train/lr")
    assert lr[1] == pytest.approx(run.optim.lr / 2) and lr[2] == pytest.approx(run.optim.lr)  # 2 warmup steps
    assert all(0 < a <= 1 for a in metric_by_step(rows, "train/accuracy").values())
    assert all(g > 0 for g in metric_by_step(rows, "train/grad_norm").values())
    assert sorted(metric_by_step(rows, "val/loss")) == [3, 6]
    # what checkpoint monitors, early stopping and the progress bar read: the last step's, as logged
    assert float(trainer.callback_metrics["train/loss"]) == pytest.approx(loss[6])
    assert float(trainer.callback_metrics["train/accuracy"]) == metric_by_step(rows, "train/accuracy")[6]
    mfu = metric_by_step(rows, "train/mfu")
    flops = metric_by_step(rows, "train/flops_per_sec_per_device")
    assert mfu and all(mfu[s] == pytest.approx(flops[s] / 1e12) for s in mfu)
    model = parts.module.model
    assert parts.module.flops_per_batch == pytest.approx(model.flops_per_token(32) * 32 * 4 / 3)  # last: val


def test_no_mfu_on_cpu_without_a_peak(tmp_path, tiny_world):
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", trainer={"max_steps": 4, "throughput_window": 2})
    run, resolved = config.load(recipe)
    parts = prepare_run(run, resolved)
    build_trainer(run, resolved).fit(parts.module, datamodule=parts.datamodule)
    rows = read_metrics(tmp_path / "run")
    assert metric_by_step(rows, "train/tokens_per_sec_per_device")  # tokens/s is there
    assert not metric_by_step(rows, "train/mfu")


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_reduced_precisions_train(tmp_path, tiny_world, precision):
    """Same seed, data and steps: the bf16 losses follow the fp32 ones (bf16 keeps ~3 significant digits)."""
    losses = {}
    for name in ("32-true", precision):
        (tmp_path / name).mkdir()
        recipe = tiny_recipe(
            tmp_path / name,
            tiny_world,
            "gpt",
            trainer={"max_steps": 3, "precision": name},
            checkpoint={"save_top_k": 0},
        )
        run, resolved = config.load(recipe)
        parts = prepare_run(run, resolved)
        build_trainer(run, resolved).fit(parts.module, datamodule=parts.datamodule)
        losses[name] = metric_by_step(read_metrics(tmp_path / name / "run"), "train/loss")
    reference, reduced = losses["32-true"], losses[precision]
    assert len(reduced) == 3 and reduced.keys() == reference.keys()
    for step, loss in reference.items():
        assert math.isfinite(reduced[step]) and abs(reduced[step] - loss) < 0.03 * loss, (step, loss, reduced)


def counted(module, forward, calls):
    def forward_and_count(*args, **kwargs):
        calls.extend([1] if module.training else [])
        return forward(*args, **kwargs)

    return forward_and_count


def test_activation_checkpointing_gives_the_same_gradients(tmp_path, tiny_world):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, _, _, plain = fit_one_step(tmp_path / "a", tiny_world, "gpt", micro=2, k=1)
    recipe = tiny_recipe(
        tmp_path / "b",
        tiny_world,
        "gpt",
        data={"micro_batch_size": 2},
        trainer={"max_steps": 1, "activation_checkpointing": True, "gradient_clip_val": None},
    )
    run, resolved = config.load(recipe)
    parts = prepare_run(run, resolved)
    blocks = parts.module.model.fsdp_units()
    calls = []  # training-mode block forwards: each block runs again in the backward pass when recomputed
    for block in blocks:  # (module forward hooks do not fire on checkpoint's recomputation: count in forward)
        block.forward = counted(block, block.forward, calls)
    capture = CaptureGrads()
    build_trainer(run, resolved, callbacks=[capture], loggers=[]).fit(
        parts.module, datamodule=parts.datamodule
    )
    assert len(calls) == 2 * len(blocks)  # one step of one micro-batch: forward + recomputation
    for name, grad in plain.items():
        torch.testing.assert_close(capture.grads[name], grad, msg=name)


def test_compiled_training_matches_eager(tmp_path, tiny_world):
    """trainer.compile=true on the CPU (inductor, the system C++ compiler): the same losses as eager."""
    losses = {}
    for compiled in (False, True):
        (tmp_path / str(compiled)).mkdir()
        recipe = tiny_recipe(
            tmp_path / str(compiled),
            tiny_world,
            "gpt",
            trainer={"max_steps": 3, "compile": compiled, "limit_val_batches": 0},
            checkpoint={"save_top_k": 0},
        )
        run, resolved = config.load(recipe)
        parts = prepare_run(run, resolved)
        torch._dynamo.utils.counters.clear()
        build_trainer(run, resolved).fit(parts.module, datamodule=parts.datamodule)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert (graphs > 0) is compiled, f"dynamo compiled {graphs} graphs (compile={compiled})"
        losses[compiled] = metric_by_step(read_metrics(tmp_path / str(compiled) / "run"), "train/loss")
    assert len(losses[True]) == 3
    for step, value in losses[False].items():
        assert losses[True][step] == pytest.approx(value, rel=1e-4)
