"""Two real processes (gloo on CPU): group statistics over all ranks, identical weights on every rank."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_runs import free_port

WORKER = Path(__file__).with_name("distributed_worker.py")
# 12 samples in groups of 4 over 2 ranks of 6: group 1 (samples 4-7) is split across the ranks.
OVERRIDES = ["rollout.batch_size=12", "rollout.group_size=4", "train.steps=3", "checkpoint.every=100"]


def accelerate_launch(processes: int, script: Path, *args: str) -> list[str]:
    """``accelerate launch`` of ``script`` on ``processes`` gloo processes, rendezvousing on a free port (the suite's
    workers may launch two at once; accelerate's default port is one for all)."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(script),
        *args,
    ]


def run_worker(tiny_yaml, out: Path, processes: int, extra: tuple[str, ...] = ()) -> list[dict]:
    out.mkdir()
    overrides = [*OVERRIDES, f"run.output_dir={out / 'run'}", *extra]
    if processes == 1:
        command = [sys.executable, str(WORKER), str(tiny_yaml), str(out), *overrides]
    else:
        command = accelerate_launch(processes, WORKER, str(tiny_yaml), str(out), *overrides)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]


@pytest.fixture(scope="module")
def single_and_ddp(tmp_path_factory) -> tuple[dict, list[dict]]:
    """The tiny run on one process and on two (DDP), shared by the tests that compare with them."""
    from conftest import TINY_YAML

    root = tmp_path_factory.mktemp("reference")
    config = root / "tiny.yaml"
    config.write_text(TINY_YAML.replace("RUN_DIR", str(root / "run")))
    (single,) = run_worker(config, root / "one", 1)
    return single, run_worker(config, root / "two", 2)


@pytest.mark.slow
@pytest.mark.xdist_group("single_and_ddp")  # one worker computes the shared runs once
def test_two_processes_match_one_process(single_and_ddp):
    single, ranks = single_and_ddp
    assert [r["num_processes"] for r in ranks] == [2, 2]
    first = [rank["steps"][0] for rank in ranks]
    assert first[0]["sample_ids"] == list(range(6)) and first[1]["sample_ids"] == list(range(6, 12))
    assert first[0]["group_ids"][-2:] == [1, 1] and first[1]["group_ids"][:2] == [1, 1]  # a split group

    # Same samples, same rewards, same advantages: the split group is normalised over both ranks.
    torch.testing.assert_close(
        torch.tensor(first[0]["rewards"] + first[1]["rewards"]),
        torch.tensor(single["steps"][0]["rewards"]),
        rtol=0,
        atol=1e-6,
    )
    advantages = torch.tensor(first[0]["advantages"] + first[1]["advantages"])
    torch.testing.assert_close(advantages, torch.tensor(single["steps"][0]["advantages"]), rtol=0, atol=1e-5)
    assert abs(advantages[4:8].mean().item()) < 1e-5 and advantages[4:8].abs().sum() > 0
    # Metrics are global: both ranks report the same mean reward.
    assert all(a["reward_metric"] == b["reward_metric"] for a, b in zip(ranks[0]["steps"], ranks[1]["steps"]))
    # After several optimizer steps the replicas hold bit-identical weights.
    assert ranks[0]["weights"] == ranks[1]["weights"]
    # Keys present on one rank only are still averaged over every rank, without a mismatched collective.
    assert ranks[0]["uneven_means"] == ranks[1]["uneven_means"] == {"rank0_only": 1.0, "rank1_only": 2.0, "shared": 0.5}


@pytest.mark.slow
@pytest.mark.xdist_group("single_and_ddp")  # one worker computes the shared runs once
def test_fsdp2_shards_the_model_and_trains_as_ddp(single_and_ddp, tiny_yaml, tmp_path):
    """train.sharding=fsdp2 on two gloo processes: each holds half of every parameter, the advantages are the
    one-process run's, the gradient norm every step and, after 3 steps, the gathered weights equal DDP's (1e-6:
    the reduction order of the gradients differs). A sharded run resumed after step 2 ends where the uninterrupted one does, and its
    export is a whole stock pipeline."""
    single, ddp = single_and_ddp
    sharded = ("train.sharding=fsdp2", "export.on_train_end=true")
    ranks = run_worker(tiny_yaml, tmp_path / "fsdp", 2, sharded)
    for rank in ranks:
        total, held = rank["steps"][0]["parameters"], rank["steps"][0]["local_parameters"]
        assert total > 10_000 and abs(held - total / 2) <= 0.01 * total, (held, total)
    for step in range(3):
        advantages = torch.tensor(ranks[0]["steps"][step]["advantages"] + ranks[1]["steps"][step]["advantages"])
        expected = torch.tensor(ddp[0]["steps"][step]["advantages"] + ddp[1]["steps"][step]["advantages"])
        torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(ranks[0]["steps"][0]["advantages"] + ranks[1]["steps"][0]["advantages"]),
        torch.tensor(single["steps"][0]["advantages"]),
        rtol=0,
        atol=1e-5,
    )
    # the whole model's gradient norm, each rank's shards' norms combined, as DDP's replicas compute it
    sharded_norms, ddp_norms = ([step["grad_norm"] for step in run[0]["steps"]] for run in (ranks, ddp))
    assert sharded_norms[0] > 0
    torch.testing.assert_close(torch.tensor(sharded_norms), torch.tensor(ddp_norms), rtol=1e-5, atol=0)
    gathered, replicated = torch.tensor(ranks[0]["weights"]), torch.tensor(ddp[0]["weights"])
    torch.testing.assert_close(gathered, replicated, rtol=0, atol=1e-6)
    assert ranks[1]["weights"] == []  # the other process never holds the whole model

    # interrupted after step 2, resumed: the sharded optimizer state comes back whole
    first = run_worker(
        tiny_yaml,
        tmp_path / "part",
        2,
        (*sharded, "train.steps=2", "checkpoint.every=1", f"run.output_dir={tmp_path / 'resumed'}"),
    )
    assert len(first[0]["steps"]) == 2
    resumed = run_worker(
        tiny_yaml, tmp_path / "rest", 2, (*sharded, "--resume", f"run.output_dir={tmp_path / 'resumed'}")
    )
    assert len(resumed[0]["steps"]) == 1
    torch.testing.assert_close(torch.tensor(resumed[0]["weights"]), gathered, rtol=0, atol=0)

    script = (
        "import sys, torch; from diffusers import StableDiffusion3Pipeline; "
        "pipe = StableDiffusion3Pipeline.from_pretrained(sys.argv[1]); "
        "print(sum(p.numel() for p in pipe.transformer.parameters()))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "fsdp" / "run" / "pipeline")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert int(loaded.stdout.split()[-1]) == ranks[0]["steps"][0]["parameters"]


@pytest.mark.slow
@pytest.mark.xdist_group("single_and_ddp")  # one worker computes the shared runs once
def test_reused_rollout_forwards_on_two_processes_train_as_ddp(single_and_ddp, tiny_yaml, tmp_path):
    """train.reuse_rollout_forward under DDP: the kept forwards' backward synchronises nothing, so their
    minibatch averages its gradients itself; the replicas stay identical and end with DDP's weights (1e-6: the
    reduction's rounding differs), for the first of two minibatches and for a single one. Each rank trains on
    its kept forwards: every trained transition of that minibatch runs the network once fewer."""
    _, ddp = single_and_ddp
    for minibatches in (1, 2):
        reuse = ("train.reuse_rollout_forward=true", f"train.num_minibatches={minibatches}")
        ranks = run_worker(tiny_yaml, tmp_path / f"reuse{minibatches}", 2, reuse)
        expected = ddp if minibatches == 1 else run_worker(tiny_yaml, tmp_path / "ddp2", 2, reuse[1:])
        # counted over the 2 steps after the first: the 3 transitions of a rank's first minibatch (6 rows in all)
        for rank, replayed in zip(ranks, expected):
            assert replayed["forward_rows"] - rank["forward_rows"] == 2 * 3 * 6 // minibatches
        assert ranks[0]["weights"] == ranks[1]["weights"]
        torch.testing.assert_close(
            torch.tensor(ranks[0]["weights"]), torch.tensor(expected[0]["weights"]), rtol=0, atol=1e-6
        )


@pytest.mark.slow
@pytest.mark.xdist_group("single_and_ddp")  # one worker computes the shared runs once
def test_a_compiled_policy_on_two_processes_trains_as_ddp(single_and_ddp, tiny_yaml, tmp_path):
    """train.compile under DDP (the network compiled in place, then wrapped): the replicas stay identical and
    follow eager DDP's weights up to the compiled kernels' rounding (3e-6 here)."""
    _, ddp = single_and_ddp
    ranks = run_worker(tiny_yaml, tmp_path / "compiled", 2, ("train.compile=true",))
    assert ranks[0]["weights"] == ranks[1]["weights"]
    torch.testing.assert_close(torch.tensor(ranks[0]["weights"]), torch.tensor(ddp[0]["weights"]), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ("regularizers=[{name: gaussian_kl, weight: 0.1}]",),
        (
            "sampler.name=ode",
            "objective={name: nft, old_policy_decay: 0.5}",
            "train.num_minibatches=2",
            "backbone.lora.enabled=true",
        ),
    ],
    ids=["kl-reference", "nft-old-policy-lora"],
)
def test_a_compiled_sharded_policy_trains_as_the_eager_sharded_one(tiny_yaml, tmp_path, overrides):
    """train.compile under FSDP2: the sharded network (and the KL's sharded reference copy) compiled in place,
    the blocks' all-gathers around the graphs, NFT's old weights copied into the shards: no graph breaks, and
    the weights follow the eager sharded run's up to the compiled kernels' rounding (4e-6 here)."""
    sharded = ("train.sharding=fsdp2", "export.on_train_end=true", *overrides)
    eager = run_worker(tiny_yaml, tmp_path / "eager", 2, sharded)
    compiled = run_worker(tiny_yaml, tmp_path / "compiled", 2, (*sharded, "train.compile=true"))
    assert [(r["compiled_graphs"] > 0, r["graph_breaks"]) for r in compiled] == [(True, 0), (True, 0)]
    assert [r["compiled_graphs"] for r in eager] == [0, 0]
    torch.testing.assert_close(
        torch.tensor(compiled[0]["weights"]), torch.tensor(eager[0]["weights"]), rtol=0, atol=1e-5
    )


@pytest.mark.slow
def test_fsdp2_trains_nft_with_an_old_policy_as_ddp_does(tiny_yaml, tmp_path):
    """The EMA old policy NFT compares with is swapped into the shards in place (FSDP gathers from the
    shards' own storage) and checkpointed whole: sharded and replicated runs end with the same weights."""
    nft = ("sampler.name=ode", "objective={name: nft, old_policy_decay: 0.5}", "train.num_minibatches=2")
    replicated = run_worker(tiny_yaml, tmp_path / "ddp", 2, nft)
    sharded = run_worker(tiny_yaml, tmp_path / "fsdp", 2, (*nft, "train.sharding=fsdp2", "export.on_train_end=true"))
    torch.testing.assert_close(
        torch.tensor(sharded[0]["weights"]), torch.tensor(replicated[0]["weights"]), rtol=0, atol=1e-6
    )


PARETO_AND_HINGE = (
    "pareto.enabled=true",
    "backbone.preference_inputs=2",
    "rewards=[jpeg_compressibility, shapes_verifier]",
    "regularizers=[velocity_norm_hinge]",
)


@pytest.mark.slow
def test_pareto_preferences_and_hinge_buckets_on_two_processes(tiny_yaml, tmp_path):
    """Per-group preference weights are the same whatever rank holds the group; the preference input
    (used outside the transformer's own forward) and the hinge's per-bucket collective keep ranks in step."""
    (single,) = run_worker(tiny_yaml, tmp_path / "one", 1, PARETO_AND_HINGE)
    ranks = run_worker(tiny_yaml, tmp_path / "two", 2, PARETO_AND_HINGE)
    for step in range(3):
        advantages = torch.tensor(ranks[0]["steps"][step]["advantages"] + ranks[1]["steps"][step]["advantages"])
        torch.testing.assert_close(advantages, torch.tensor(single["steps"][step]["advantages"]), rtol=0, atol=1e-4)
        assert ranks[0]["steps"][step]["reward_metric"] == ranks[1]["steps"][step]["reward_metric"]
    assert ranks[0]["weights"] == ranks[1]["weights"]


@pytest.mark.slow
def test_a_token_policy_on_two_processes_matches_one(llm_yaml, tmp_path):
    """12 completions in groups of 4 over 2 ranks of 6: group 1 spans both. Same completions, rewards and
    advantages as one process (each token's noise depends on its sample's id alone), identical weights."""
    extra = (
        "rollout.batch_size=12",
        "rollout.group_size=4",
        "train.steps=2",
        "checkpoint.every=100",
        "objective.loss_type=dapo",
        "objective.kl_beta=0.05",
    )
    (single,) = run_worker(llm_yaml, tmp_path / "one", 1, extra)
    ranks = run_worker(llm_yaml, tmp_path / "two", 2, extra)
    both = [rank["steps"][0] for rank in ranks]
    assert both[0]["sample_ids"] + both[1]["sample_ids"] == list(range(12))
    assert both[0]["group_ids"][-2:] == [1, 1] and both[1]["group_ids"][:2] == [1, 1]  # a split group
    torch.testing.assert_close(
        torch.tensor(both[0]["rewards"] + both[1]["rewards"]),
        torch.tensor(single["steps"][0]["rewards"]),
        rtol=0,
        atol=0,
    )
    advantages = torch.tensor(both[0]["advantages"] + both[1]["advantages"])
    torch.testing.assert_close(advantages, torch.tensor(single["steps"][0]["advantages"]), rtol=0, atol=1e-6)
    assert advantages[4:8].abs().sum() > 0 and abs(advantages[4:8].mean().item()) < 1e-6
    assert ranks[0]["weights"] == ranks[1]["weights"]  # after two updates, bit-identical replicas


@pytest.mark.slow
def test_a_reward_failing_on_one_process_stops_every_process_with_the_reward_named(tiny_yaml, tmp_path):
    """Rank 1's reward raises at step 2: both processes exit non-zero within a minute, each naming the reward, and
    the checkpoint of step 2 (the last finished step) is intact."""
    from gyremedia.runtime.checkpoint import latest_checkpoint, list_checkpoints

    run = tmp_path / "run"
    command = accelerate_launch(
        2,
        WORKER.with_name("reward_failure_worker.py"),
        "1",
        "2",
        "raise",
        "train",
        str(tiny_yaml),
        f"run.output_dir={run}",
        "rewards=[fails_at_step]",
        "rollout.batch_size=12",
        "rollout.group_size=4",
        "eval.samples=4",
        "train.steps=4",
        "checkpoint.every=1",
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0 and time.monotonic() - start < 60
    errors = sorted(line for line in done.stderr.splitlines() if line.startswith("gyremedia: error:"))
    assert len(errors) == 2, done.stderr[-3000:]
    failed = "reward 'fails_at_step' failed at step 2 on prompts "
    assert errors[0].startswith("gyremedia: error: process 1 failed, so every process stops: RewardError: " + failed)
    assert errors[1].startswith("gyremedia: error: " + failed)
    assert all(e.endswith("ConnectionError: judge unreachable") for e in errors)
    assert [p.name for p in list_checkpoints(run)][-1] == "step-000002"
    assert latest_checkpoint(run) == run / "checkpoints" / "step-000002"
