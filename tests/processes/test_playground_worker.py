"""The playground's worker side with real parts: generations queued through the API on SQLite, run by the worker's job
handler in its real playground process, on real tiny models and real checkpoints (a LoRA adapter on its base, the
same adapter merged into a full checkpoint), with images from the store that the model sees; the run's rewards
with the worker's allowlist; cancel at the next token; clear failures; the idle timeout; the process ending with its
worker; temperature zero as greedy decoding."""

from __future__ import annotations

import io
import os
import shutil
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageOps

from collage.training.config import parse_config
from tests.support import API
from tests.support.api import RecordingDispatcher, config
from tests.support.waiting import scaled, wait_for

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def picture() -> Image.Image:
    image = Image.new("RGB", (64, 48), (30, 30, 200))
    image.paste((230, 20, 20), (8, 8, 30, 30))
    return image


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir):
    """``(adapter, merged)``: checkpoint folders (``<step>/model``) of the same LoRA adapter on tiny Qwen2-VL, as
    the trainer saves them, and of the adapter merged into the base weights (a full checkpoint)."""
    import torch

    from collage.training.config import LoraSettings, ModelSettings
    from collage.training.modeling import apply_lora
    from collage.training.models.loading import load_model, load_processor

    root = tmp_path_factory.mktemp("checkpoints")
    base = str(tiny_model_dir("qwen2-vl"))
    processor, _ = load_processor(base)
    torch.manual_seed(0)
    lora = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    model = apply_lora(load_model(base, "float32"), ModelSettings(path=base, lora=lora))
    with torch.no_grad():  # a trained adapter: B is no longer zero, so the adapter changes what the model says
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    adapter, merged = root / "adapter" / "step-2", root / "merged" / "step-2"
    model.save_pretrained(adapter / "model")
    processor.save_pretrained(adapter / "model")
    full = model.merge_and_unload()
    full.save_pretrained(merged / "model")
    processor.save_pretrained(merged / "model")
    return adapter, merged


@pytest.fixture
def play(migrated_sqlite_url, tmp_path):
    """The API (to queue generations) and the worker's settings; generations run by :func:`run`."""
    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.engine import engine_for
    from collage.app.store.tokens import create_token
    from tests.support.services import truncate

    truncate(migrated_sqlite_url)
    settings = Settings(home=Path(os.environ["COLLAGE_HOME"]), database_url=migrated_sqlite_url,
                        broker_url="memory://", artifacts=tmp_path / "artifacts", model_roots=(tmp_path / "models",),
                        reward_modules=("tests.support.rewards",), heartbeat_interval=0.5, cancel_grace=scaled(60),
                        playground_ttl=600)  # fmt: skip
    app = create_app(settings, RecordingDispatcher())
    token = create_token(engine_for(migrated_sqlite_url), "admin", role="admin")
    client = TestClient(app, headers={"Authorization": f"Bearer {token}"})
    return client, app, settings


def upload(client: TestClient, image: Image.Image) -> str:
    response = client.post(API + "/images", files={"file": ("x.png", _png(image), "image/png")})
    assert response.status_code == 201, response.text
    return response.json()["sha256"]


def add_run(app, checkpoint: Path | None, kind: str = "full", lora: bool = False, rewards=None) -> str:
    changes = {"rewards": rewards or [{"name": "accuracy"}, {"name": "numeric", "weight": 0.5}],
               "train": {"max_steps": 4, "max_prompt_length": 256, "max_completion_length": 6},
               "model": {"path": "tiny:qwen2-vl", "dtype": "float32", **({"lora": {"r": 4, "alpha": 8}} if lora else {})}}  # fmt: skip
    run = app.state.writer.create_run(parse_config(config(**changes)).model_dump(mode="json"))
    if checkpoint is not None:
        # the playground reads a checkpoint only from the run's own folder, where a worker writes it
        folder = app.state.settings.artifacts / "runs" / run.id / "checkpoints" / "step-2"
        if checkpoint.exists():
            shutil.copytree(checkpoint, folder)
        app.state.writer.add_checkpoint(run.id, 2, str(folder), kind=kind, size=1)
    return run.id


def queue(client: TestClient, **body) -> str:
    request = {"prompt": "How many red squares?", "num_generations": 3, "max_new_tokens": 6,
               "temperature": 1.0, "top_p": 1.0, **body}  # fmt: skip
    response = client.post(API + "/generate", json=request)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def run(app, settings, job_id: str) -> dict:
    """Claim the job as a worker would and run it to its end in this process (its handler talks to the real
    playground process); returns the job as the API shows it, plus its stored result."""
    from collage.app.store import jobs
    from collage.worker.jobs import run_job

    job = jobs.claim_next_job(app.state.engine, "default", "test-worker")
    assert job is not None and job.id == job_id
    run_job(job, settings, "test-worker")
    stored = jobs.get_job(app.state.engine, job_id)
    return {"status": stored.status, "error": stored.error, "result": stored.result, "message": stored.message}


def texts(result: dict, model: int = 0) -> list[str]:
    return [c["text"] for c in result["results"][model]["completions"]]


def logprobs(result: dict, model: int = 0) -> list[float]:
    return [c["logprob"] for c in result["results"][model]["completions"]]


def test_a_lora_checkpoint_loads_onto_its_base_and_matches_its_merged_weights(play, checkpoints):
    client, app, settings = play
    adapter, merged = checkpoints
    rewards = [{"name": "accuracy"}, {"name": "format", "weight": 0.2},
               {"name": "tests.support.rewards:sees_columns"}]  # fmt: skip
    lora_run = add_run(app, adapter, kind="adapter", lora=True, rewards=rewards)
    full_run = add_run(app, merged, kind="full", rewards=rewards)
    sha = upload(client, picture())
    job = queue(client, models=[{"run": lora_run, "step": 2}, {"run": full_run, "step": "last"}], images=[sha], prompt="Here: [image 1]. How many red squares?",
                answer="1", columns={"task": "count-red"}, seed=11)  # fmt: skip
    done = run(app, settings, job)
    assert done["status"] == "succeeded", done
    shown = client.get(f"{API}/generate/{job}").json()
    assert shown["status"] == "succeeded" and len(shown["results"]) == 2
    lora, full = shown["results"]
    assert lora["model"]["step"] == 2 and lora["model"]["kind"] == "adapter" and full["model"]["kind"] == "full"
    # the adapter on its base says what the merged weights say: the same completions, the same log-probs
    assert texts(shown, 0) == texts(shown, 1)
    assert max(abs(a - b) for a, b in zip(logprobs(shown, 0), logprobs(shown, 1), strict=True)) < 1e-3
    assert lora["prompt_tokens"] == full["prompt_tokens"] and lora["image_tokens"] > 0
    # every reward of the run, on each completion, as training computes them (the dataset columns reach them)
    for result in (lora, full):
        assert set(result["rewards"]) == {"accuracy", "format", "sees_columns"}
        assert result["rewards"]["sees_columns"] == [1.0, 1.0, 1.0]
        assert all(len(v) == 3 for v in result["rewards"].values())
        assert result["reward_weights"] == {"accuracy": 1.0, "format": 0.2, "sees_columns": 1.0}
        for i, completion in enumerate(result["completions"]):
            total = sum(result["reward_weights"][k] * v[i] for k, v in result["rewards"].items())
            assert completion["reward"] == pytest.approx(total)
    # the base model alone, with the same seed, says something else: the adapter was applied
    base = run(app, settings, queue(client, models=[{"path": "tiny:qwen2-vl"}], images=[sha], seed=11))
    assert max(abs(a - b) for a, b in zip(logprobs(base["result"]), logprobs(shown), strict=True)) > 1e-3


def test_the_model_sees_its_images_and_stays_loaded(play):
    client, app, settings = play
    red, inverted = upload(client, picture()), upload(client, ImageOps.invert(picture()))
    models = [{"path": "tiny:qwen2-vl"}]
    first = run(app, settings, queue(client, models=models, images=[red], seed=3))
    again = run(app, settings, queue(client, models=models, images=[red], seed=3))
    other = run(app, settings, queue(client, models=models, images=[inverted], seed=3))
    assert first["status"] == again["status"] == other["status"] == "succeeded", (first, again, other)
    # the same model, seed and image: the same completions, from the model still loaded in the same process
    assert texts(first["result"]) == texts(again["result"]) and logprobs(first["result"]) == logprobs(again["result"])
    assert again["result"]["results"][0]["reused"] and again["result"]["pid"] == first["result"]["pid"]
    # the same prompt with the colour negative of its image (same size, so the same tokens): the model sees it
    assert first["result"]["results"][0]["prompt_tokens"] == other["result"]["results"][0]["prompt_tokens"]
    shift = max(abs(a - b) for a, b in zip(logprobs(first["result"]), logprobs(other["result"]), strict=True))
    assert shift > 1e-3, shift
    # without an answer no reward is computed
    assert first["result"]["results"][0]["rewards"] is None


def test_rewards_run_only_under_the_workers_allowlist(play, checkpoints):
    client, app, settings = play
    from dataclasses import replace

    run_id = add_run(
        app, checkpoints[1], rewards=[{"name": "accuracy"}, {"name": "tests.support.rewards:starts_with_digit"}]
    )
    strict = replace(settings, reward_modules=())  # this worker allows no reward module
    done = run(app, strict, queue(client, models=[{"run": run_id}], answer="2"))
    assert done["status"] == "succeeded", done
    result = done["result"]["results"][0]
    assert set(result["rewards"]) == {"accuracy"}
    assert "not allowlisted" in result["reward_errors"]["starts_with_digit"]


def test_cancel_stops_a_generation_at_its_next_token_and_keeps_the_model(play):
    from collage.worker.playground.service import PROCESS

    client, app, settings = play
    job = queue(client, models=[{"path": "tiny:qwen2-vl"}], num_generations=16, max_new_tokens=1024, seed=1)
    outcome: dict = {}
    worker = threading.Thread(target=lambda: outcome.update(run(app, settings, job)))
    worker.start()
    wait_for(lambda: "generating" in (client.get(f"{API}/generate/{job}").json()["message"] or ""), "the generation to start", timeout=300)  # fmt: skip
    pid = PROCESS.pid
    cancelled = client.post(f"{API}/generate/{job}/cancel").json()
    assert cancelled["status"] == "running"  # cancelling shows as running until it stops
    worker.join(timeout=scaled(120))
    assert not worker.is_alive() and outcome["status"] == "cancelled", outcome
    # it stopped in the middle of generating (at its next token), not after 16 completions of 1024 tokens
    assert outcome["message"] == "cancelled while generating: model 1/1 (tiny:qwen2-vl)", outcome
    assert client.get(f"{API}/generate/{job}").json()["status"] == "cancelled"
    # stopped by the process itself (not killed): the same process, the model still loaded, answers the next one
    assert PROCESS.pid == pid
    after = run(app, settings, queue(client, models=[{"path": "tiny:qwen2-vl"}], max_new_tokens=2))
    assert (
        after["status"] == "succeeded" and after["result"]["results"][0]["reused"] and after["result"]["pid"] == pid
    ), (pid, after["result"]["results"][0]["reused"], after["result"]["results"][0]["seconds"], after["result"]["pid"])


def test_missing_checkpoints_bad_images_and_wrong_folders_fail_clearly(play, checkpoints, tmp_path):
    client, app, settings = play
    gone = add_run(app, tmp_path / "deleted" / "step-2")
    done = run(app, settings, queue(client, models=[{"run": gone}]))
    assert done["status"] == "failed" and "no longer on disk" in done["error"], done
    # an image whose file was damaged, and one whose file is gone
    sha = upload(client, picture())
    file = settings.artifacts / "images" / sha[:2] / sha[2:4] / f"{sha}.png"
    file.write_bytes(b"\x89PNG\r\n\x1a\n broken")
    done = run(app, settings, queue(client, models=[{"path": "tiny:qwen2-vl"}], images=[sha]))
    assert done["status"] == "failed" and f"image 1 ({sha[:12]}...) is unreadable" in done["error"], done
    file.unlink()
    done = run(app, settings, queue(client, models=[{"path": "tiny:qwen2-vl"}], images=[sha]))
    assert done["status"] == "failed" and "is missing from the artifacts store" in done["error"], done
    # a LoRA adapter folder or an empty folder named as a base model under the roots
    models = settings.model_roots[0]
    (models / "empty").mkdir(parents=True)

    shutil.copytree(checkpoints[0] / "model", models / "adapter")
    for folder, why in [("adapter", "a LoRA adapter folder, not a model"), ("empty", "no model folder there")]:
        done = run(app, settings, queue(client, models=[{"path": str(models / folder)}]))
        assert done["status"] == "failed" and why in done["error"], done
    # the worker checks the roots again: a path the web node allowed but this worker's roots do not
    from dataclasses import replace

    elsewhere = replace(settings, model_roots=(tmp_path / "other",))
    done = run(app, elsewhere, queue(client, models=[{"path": str(models / "empty")}]))
    assert done["status"] == "failed" and "refused by this worker" in done["error"], done


def test_the_process_exits_after_its_idle_time_and_a_new_one_serves_the_next(play):
    from dataclasses import replace

    from collage.worker.playground.service import PROCESS

    client, app, settings = play
    PROCESS.stop("the test wants a short idle time")
    short = replace(settings, playground_ttl=3)
    first = run(app, short, queue(client, models=[{"path": "tiny:qwen2-vl"}], max_new_tokens=2))
    pid = first["result"]["pid"]
    assert first["status"] == "succeeded" and not first["result"]["results"][0]["reused"]
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), "the idle playground process to exit", timeout=120)
    second = run(app, short, queue(client, models=[{"path": "tiny:qwen2-vl"}], max_new_tokens=2))
    assert second["status"] == "succeeded" and second["result"]["pid"] != pid
    assert not second["result"]["results"][0]["reused"]  # loaded afresh by the new process
    PROCESS.stop("end of the test")


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its parent, gone, never waited for it)


def test_the_playground_process_ends_with_its_worker_even_while_busy():
    """The worker killed with SIGKILL: its playground process exits too, even when nothing closes its input (a
    process in the middle of a generation reads no input); here the test itself keeps that input open."""
    import signal
    import subprocess
    import sys

    script = (
        "import os, subprocess, sys, time\n"
        "env = dict(os.environ, COLLAGE_PLAYGROUND_PARENT=str(os.getpid()), COLLAGE_PLAYGROUND_TTL='600')\n"
        "child = subprocess.Popen([sys.executable, '-m', 'collage.worker.playground.process'], stdin=sys.stdin, env=env)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pid = int(worker.stdout.readline())
    wait_for(
        lambda: _running(pid) and "collage.worker.playground.process" in Path(f"/proc/{pid}/cmdline").read_text(),
        "the child",
        timeout=30,
    )
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    wait_for(lambda: not _running(pid), "the playground process to end with its worker", timeout=60)
    worker.stdin.close()


def test_temperature_zero_is_greedy_decoding(play):
    """Temperature 0 asks for the most likely token each step: every completion of a request is the same, whatever
    the seed (nothing is drawn)."""
    client, app, settings = play
    image = upload(client, picture())
    models = [{"path": "tiny:qwen2-vl"}]
    first = run(app, settings, queue(client, models=models, images=[image], temperature=0.0, seed=1))
    other = run(app, settings, queue(client, models=models, images=[image], temperature=0.0, seed=2))
    assert first["status"] == other["status"] == "succeeded", (first, other)
    assert len(set(texts(first["result"]))) == 1 and texts(first["result"]) == texts(other["result"])


# ------------------------------------------------------------------------------------------------------- tools
MARKER = "zoom-test"  # the scripted model answers only prompts holding it (tests/support/scripted_turns)


def board() -> Image.Image:
    """96 x 72, a red square and a blue one: every pixel of a crop tells where it was cut."""
    image = Image.new("RGB", (96, 72), (240, 240, 240))
    for x in range(0, 96, 8):  # a ramp, so that crops of different places never look alike
        image.paste((x * 2, 120, 255 - x * 2), (x, 60, x + 8, 72))
    image.paste((230, 20, 20), (10, 10, 40, 40))
    image.paste((20, 20, 230), (50, 20, 90, 50))
    return image


def decoded(tool_image: dict) -> Image.Image:
    import base64

    return Image.open(io.BytesIO(base64.b64decode(tool_image["png"]))).convert("RGB")


@pytest.fixture
def scripted(monkeypatch):
    """A playground process whose model is scripted (tests/support/scripted.py): ``script(turns)`` (re)starts it
    with the turns it answers a prompt holding MARKER with; after the test the next process is a plain one."""
    from collage.worker.playground.service import PROCESS
    from tests.support.scripted import scripted_env

    def script(turns: list[str]) -> None:
        PROCESS.stop("the test scripts the model")
        for key, value in scripted_env(MARKER, turns).items():
            monkeypatch.setenv(key, value)

    yield script
    PROCESS.stop("end of the scripted test")


def _tool_run(app, checkpoint: Path, tools: list[dict], **train) -> str:
    changes = {"rewards": [{"name": "accuracy"}, {"name": "tool_format", "weight": 0.5}], "tools": tools,
               "train": {"max_steps": 4, "max_prompt_length": 1024, "max_completion_length": 64, **train},
               "model": {"path": "tiny:qwen2-vl", "dtype": "float32"}}  # fmt: skip
    run = app.state.writer.create_run(parse_config(config(**changes)).model_dump(mode="json"))
    folder = app.state.settings.artifacts / "runs" / run.id / "checkpoints" / "step-2"
    shutil.copytree(checkpoint, folder)
    app.state.writer.add_checkpoint(run.id, 2, str(folder), kind="full", size=1)
    return run.id


def test_a_model_that_calls_tools_zooms_turn_by_turn_and_its_crops_come_back(play, checkpoints, scripted):
    """The run's own tools by default: the model zooms on the prompt's image, then on that crop, then names an
    image that does not exist (a tool error it is shown), and answers; every turn comes back, each crop as the
    pixels the tool cut, with the box it was cut from; the run's rewards see the trajectory."""
    from collage.training.tools.image_tools import MIN_CROP_SIDE
    from tests.support.scripted import call

    client, app, settings = play
    first, second = [8, 6, 72, 54], [4, 4, 40, 36]
    scripted([call("image_zoom_in", image=0, bbox_2d=first), call("image_zoom_in", image=1, bbox_2d=second),
              call("image_zoom_in", image=7, bbox_2d=second), "<answer>1</answer>"])  # fmt: skip
    run_id = _tool_run(app, checkpoints[1], [{"name": "image_zoom_in"}], max_tool_calling_iterations=3)
    sha = upload(client, board())
    job = queue(client, models=[{"run": run_id}], images=[sha], prompt=f"{MARKER}: how many red squares?",
                answer="1", num_generations=2, max_new_tokens=900, seed=4)  # fmt: skip
    done = run(app, settings, job)
    assert done["status"] == "succeeded", done
    shown = client.get(f"{API}/generate/{job}").json()
    assert shown["sampling"]["tools"] == ["image_zoom_in"] and shown["sampling"]["max_tool_calling_iterations"] == 3
    (result,) = shown["results"]
    assert len(result["completions"]) == 2
    crop1 = board().crop(tuple(first))
    crop2 = crop1.crop(tuple(second))
    for completion in result["completions"]:
        assert completion["text"] == "<answer>1</answer>" and not completion["truncated"]
        trajectory = completion["trajectory"]
        turns = trajectory["turns"]
        assert [t["role"] for t in turns] == ["assistant", "tool"] * 3 + ["assistant"]
        assert (trajectory["tool_calls"], trajectory["tool_errors"], trajectory["capped"]) == (3, 1, False)
        assert turns[0]["tool_call"] == {"name": "image_zoom_in", "arguments": {"image": 0, "bbox_2d": first}}
        assert turns[1]["tool_call"] == turns[0]["tool_call"] and turns[1]["error"] is None
        assert turns[1]["text"] == f"Zoomed in on {first} of image 0."
        # each crop: the tool's own pixels (a lossless PNG), its size, and the box of the image it was cut from
        (image1,) = turns[1]["images"]
        assert image1["source"] == {"image": 0, "bbox_2d": first}
        assert (image1["width"], image1["height"]) == crop1.size and decoded(image1).tobytes() == crop1.tobytes()
        (image2,) = turns[3]["images"]
        assert image2["source"] == {"image": 1, "bbox_2d": second}  # the first crop is image 1
        assert (image2["width"], image2["height"]) == crop2.size and decoded(image2).tobytes() == crop2.tobytes()
        assert min(crop2.size) >= MIN_CROP_SIDE
        # the third call names an image that is not there: the model was shown the error, and it is counted
        assert turns[5]["images"] == [] and "image must be an image number from 0 to 2" in turns[5]["error"]
        assert turns[5]["text"] == turns[5]["error"]
        assert completion["tokens"] > 0 and completion["logprob"] is not None
    # the run's rewards, with the trajectory: tool_format sees the calls (two worked, one failed)
    assert set(result["rewards"]) == {"accuracy", "tool_format"} and result["rewards"]["accuracy"] == [1.0, 1.0]
    assert all(v is not None for v in result["rewards"]["tool_format"])
    assert result["prompt_tokens"] > 0 and result["image_tokens"] > 0


def test_an_operators_tool_runs_where_the_worker_allows_it_and_is_refused_where_it_does_not(play, scripted):
    from dataclasses import replace

    from tests.support.scripted import call

    client, app, settings = play
    scripted([call("shout", text="hello"), "done"])
    app.state.settings = replace(app.state.settings, tool_modules=("tests.support.tool_env",))
    body = {"models": [{"path": "tiny:qwen2-vl"}], "prompt": f"{MARKER}: say it", "max_new_tokens": 400,
            "tools": ["tests.support.tool_env:shout"], "max_tool_calling_iterations": 1}  # fmt: skip
    allowing = replace(settings, tool_modules=("tests.support.tool_env",))
    done = run(app, allowing, queue(client, **body, num_generations=1))
    assert done["status"] == "succeeded", done
    (completion,) = done["result"]["results"][0]["completions"]
    turns = completion["trajectory"]["turns"]
    assert [(t["role"], t["text"]) for t in turns[1:]] == [("tool", "HELLO"), ("assistant", "done")]
    assert turns[0]["tool_call"] == {"name": "shout", "arguments": {"text": "hello"}}
    # the web node allowed it; this worker's own COLLAGE_TOOL_MODULES does not: refused before any import
    refused = run(app, settings, queue(client, **body))
    assert refused["status"] == "failed", refused
    assert "tool 'tests.support.tool_env:shout': refused by this worker" in refused["error"]
    assert "COLLAGE_TOOL_MODULES" in refused["error"]


def test_a_real_model_with_tools_is_shown_their_schemas_and_its_trajectory_is_whole(play):
    """A tiny random model given the zoom tool (it never calls one): its prompt holds the tool's schema (more
    tokens), each completion's trajectory is one answer turn, and a generation without tools in the same process
    is encoded as before (the tools never leak into the encoder of plain prompts)."""
    client, app, settings = play
    sha = upload(client, picture())
    plain = dict(models=[{"path": "tiny:qwen2-vl"}], images=[sha], seed=2, max_new_tokens=12)
    before = run(app, settings, queue(client, **plain))
    tooled = run(app, settings, queue(client, **plain, tools=["image_zoom_in", "image_rotate"]))
    after = run(app, settings, queue(client, **plain))
    assert before["status"] == tooled["status"] == after["status"] == "succeeded", (before, tooled, after)
    b, t, a = (x["result"]["results"][0] for x in (before, tooled, after))
    assert t["prompt_tokens"] > b["prompt_tokens"] + 100 and a["prompt_tokens"] == b["prompt_tokens"]
    assert a["reused"] and texts(after["result"]) == texts(before["result"])
    assert all(c.get("trajectory") is None for c in b["completions"])
    for completion in t["completions"]:
        trajectory = completion["trajectory"]
        calls = sum(turn["role"] == "tool" for turn in trajectory["turns"])
        assert trajectory["turns"][0]["role"] == "assistant" and trajectory["tool_calls"] == calls
        assert trajectory["turns"][-1]["text"] == completion["text"] or completion["truncated"]
        assert completion["tokens"] <= 12
