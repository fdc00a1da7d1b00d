"""The allocator cap an engine sets on a CUDA device is process-wide: the last engine on the
device to go puts back the cap from before the first (torch.cuda's calls replaced here)."""
import torch

from mempath.memory import device_cap


def install(monkeypatch, fractions):
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: fractions[index],
                        raising=False)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index: fractions.__setitem__(index, fraction))
    monkeypatch.setattr(device_cap, "_holders", {})


def test_the_last_engine_on_a_device_puts_the_cap_back(monkeypatch):
    fractions = {0: 0.7, 1: 1.0}
    install(monkeypatch, fractions)
    first = device_cap.hold_device_cap(torch.device("cuda", 0))
    torch.cuda.set_per_process_memory_fraction(0.9, 0)  # what the first engine's start-up sets
    second = device_cap.hold_device_cap(torch.device("cuda", 0))
    torch.cuda.set_per_process_memory_fraction(0.5, 0)
    other_device = device_cap.hold_device_cap(torch.device("cuda", 1))
    torch.cuda.set_per_process_memory_fraction(0.8, 1)
    first()
    first()  # a second release of the same hold is not another engine leaving
    assert fractions == {0: 0.5, 1: 0.8}
    second()
    assert fractions == {0: 0.7, 1: 0.8}
    other_device()
    assert fractions == {0: 0.7, 1: 1.0}


def test_a_hold_after_every_release_keeps_the_cap_of_its_own_time(monkeypatch):
    fractions = {0: 1.0}
    install(monkeypatch, fractions)
    device_cap.hold_device_cap(torch.device("cuda", 0))()
    fractions[0] = 0.6  # the user's own cap, set between two engines
    release = device_cap.hold_device_cap(torch.device("cuda", 0))
    fractions[0] = 0.9
    release()
    assert fractions[0] == 0.6
