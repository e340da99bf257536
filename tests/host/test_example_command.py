"""The README's first command ends in tests/run_example.py: on one real ComfyUI server it runs each bundled
workflow given, with generated inputs under the names the workflow loads, and prints the path of each playable
mp4 with a stereo soundtrack; a failure names the failing node and its error."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import run_example
from comfy_host import PromptRefused, failure_message
from test_host_runs import check_mp4
from ui_to_api import EMBEDDED_SIZE, embedded_default, to_api

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / "workflows"
EXAMPLES = ("h3_t2va", "h3_fl2va", "h3_ref2va", "h3_extend")


def test_every_bundled_example_runs_on_one_server_and_prints_its_mp4(tmp_path):
    command = [sys.executable, str(ROOT / "tests" / "run_example.py"), "--out", str(tmp_path / "run")]
    for name in EXAMPLES:
        command += ["--workflow", str(WORKFLOWS / f"{name}.json")]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tiny RANDOM checkpoints" in proc.stderr and proc.stderr.count("starting ComfyUI") == 1
    assert "GENERATED test inputs" in proc.stderr
    inputs = tmp_path / "run" / "input"
    for name in ("h3_first_frame.png", "h3_last_frame.png", "h3_reference_image.png", "h3_reference_audio.wav"):
        assert (inputs / name).is_file(), name
    paths = [Path(line) for line in proc.stdout.splitlines()]
    assert paths == [tmp_path / "run" / "output" / "H3" / f"{name[3:]}_00001.mp4" for name in EXAMPLES]
    for name, path in zip(EXAMPLES, paths):
        extended = 34 if name == "h3_extend" else 0  # the extend example adds 34 frames to its clip
        check_mp4(path, EMBEDDED_SIZE["length"] + extended, EMBEDDED_SIZE["width"], EMBEDDED_SIZE["height"])


def _ref2va(server):
    return embedded_default(to_api(json.loads((WORKFLOWS / "h3_ref2va.json").read_text()), server.object_info()))


def _node(prompt, class_type):
    return next((key, node) for key, node in prompt.items() if node["class_type"] == class_type)


def _readable(message):
    assert "{" not in message and "node_errors" not in message and "exception_message" not in message, message


def test_a_refused_prompt_names_the_node_and_its_error(server):
    prompt = _ref2va(server)
    node_id, node = _node(prompt, "LoadImage")
    node["inputs"]["image"] = "no_such_reference.png"
    answer = server.queue(prompt)
    assert "prompt_id" not in answer
    message = failure_message(answer)
    assert message.startswith("the server refused the prompt: ")
    assert f"node {node_id} (LoadImage): " in message and "no_such_reference.png" in message, message
    _readable(message)
    with pytest.raises(PromptRefused, match=f"node {node_id} \\(LoadImage\\)"):
        server.run(prompt)


def test_a_failed_run_names_the_node_and_its_exception(server):
    prompt = _ref2va(server)
    node_id, node = _node(prompt, "H3LoadAudio")
    node["inputs"]["audio_file"] = "first.png"  # in the input folder, but no audio
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "error"
    message = failure_message(entry)
    assert message.startswith(f"node {node_id} (H3LoadAudio) failed: ") and "first.png" in message, message
    _readable(message)


def test_the_example_stops_with_the_failing_nodes_error(server, tmp_path, capsys):
    workflow = json.loads((WORKFLOWS / "h3_t2va.json").read_text())
    sampler = next(node for node in workflow["nodes"] if node["type"] == "H3Sampler")
    sampler["widgets_values"][0] = "FL2VA"  # with no keyframes connected
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(workflow))
    with pytest.raises(SystemExit) as stopped:
        run_example.main(["--workflow", str(broken)], server=server)
    # a text exit code: Python prints it to stderr and exits with status 1
    message = stopped.value.code
    assert isinstance(message, str)
    assert message.startswith("broken.json: the server refused the prompt: ")
    assert f"node {sampler['id']} (H3Sampler): " in message and "mode FL2VA: needs a first_frame" in message, message
    _readable(message)
    assert capsys.readouterr().out == ""
