"""``nodes._gc``: a server's start-up objects set aside from the host's collections, only before any prompt was
queued and unless switched off; garbage pending at that moment is still freed, and so is later garbage. Each case
runs in a fresh interpreter (a freeze lasts for the process)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import gc, importlib.util, json, sys, threading, weakref
    spec = importlib.util.spec_from_file_location("h3_gc", sys.argv[1])
    h3_gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(h3_gc)

    class Queue:  # the host's PromptQueue as read: its lock, the prompts its worker took, those waiting
        def __init__(self, taken, waiting=()):
            self.mutex, self.task_counter, self.queue = threading.RLock(), taken, list(waiting)

    class Node:
        pass

    def cycle():
        node = Node()
        node.me = node
        return node

    kept = cycle()  # alive for the whole process
    dropped = cycle()
    dropped_ref = weakref.ref(dropped)
    del dropped  # garbage the collector alone can free
    queue = {
        "none": None,
        "unlocked": object(),
        "taken": Queue(1),
        "waiting": Queue(0, [(0, "a prompt")]),
        "fresh": Queue(0),
    }[sys.argv[2]]
    done = h3_gc.set_aside_startup_objects(queue)
    later = cycle()
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    print(json.dumps({
        "done": done,
        "frozen": gc.get_freeze_count(),
        "kept_tracked": any(o is kept for o in gc.get_objects()),
        "dropped_freed": dropped_ref() is None,
        "later_freed": later_ref() is None,
    }))
    """
)


def run(queue: str, switch: str | None = None) -> dict:
    env = None
    if switch is not None:
        import os

        env = {**os.environ, "H3_GC_FREEZE": switch}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "nodes" / "_gc.py"), queue],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_before_any_prompt_the_live_objects_are_frozen_and_garbage_is_still_freed():
    got = run("fresh")
    count, seconds = got["done"]
    assert count == got["frozen"] > 1000 and seconds >= 0
    assert not got["kept_tracked"]  # set aside: the collections no longer walk it
    assert got["dropped_freed"]  # collected before the freeze, not kept for ever
    assert got["later_freed"]  # objects made after the freeze are collected as before


def test_nothing_is_frozen_once_a_prompt_was_queued_or_without_a_queue_or_when_switched_off():
    for got in (run("taken"), run("waiting"), run("none"), run("unlocked"), run("fresh", switch="0")):
        assert got["done"] is None and got["frozen"] == 0 and got["kept_tracked"], got
        assert got["dropped_freed"] and got["later_freed"]
