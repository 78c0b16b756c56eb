"""Library code must not change process-wide torch state (tests and users train in the same
process after calling export/verify). Runs last in its directory order and checks the state the
whole suite left behind is still the default."""

import pytest

torch = pytest.importorskip("torch")


def test_autograd_is_still_enabled():
    assert torch.is_grad_enabled(), "some code called torch.set_grad_enabled(False) globally"
