"""specdec/validation.py: the shared request checks, their statuses and
their wording (the services' use of them over gRPC is checked message by
message in tests/test_bad_input_corpus.py, MESSAGES)."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.errors import InvalidArgument
from specdec.validation import check_min_confidence, check_token_id, check_token_ids


@pytest.mark.parametrize("ids", [[0, 5, 9], np.array([0, 9]), [], np.array([], dtype=np.int64)])
def test_ids_inside_the_vocabulary_pass(ids: object) -> None:
    check_token_ids(ids, 10, "token_ids")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "ids,bad",
    [([1, 10, 2], 10), ([1, -1], -1), (np.array([3, 12, -4]), 12), (np.array([-4, 3]), -4), ([2**40], 2**40)],
)
def test_the_first_id_outside_the_vocabulary_is_named(ids: object, bad: int) -> None:
    with pytest.raises(InvalidArgument) as e:
        check_token_ids(ids, 10, "draft_probs[2].token_ids")  # type: ignore[arg-type]
    assert e.value.message == f"draft_probs[2].token_ids contains token id {bad}, outside the vocabulary [0, 10)"


def test_a_single_id() -> None:
    check_token_id(9, 10, "post_token_id")
    for bad in (10, -1):
        with pytest.raises(InvalidArgument, match=rf"^post_token_id {bad} is outside the vocabulary \[0, 10\)$"):
            check_token_id(bad, 10, "post_token_id")


@pytest.mark.parametrize("value", [0.0, 0.5, 1.0])
def test_min_confidence_in_the_closed_interval(value: float) -> None:
    assert check_min_confidence(value) == value


@pytest.mark.parametrize("value", [-0.1, 1.0000001, float("nan"), float("inf"), -float("inf")])
def test_min_confidence_outside_is_refused(value: float) -> None:
    with pytest.raises(InvalidArgument, match=r"^min_confidence must be in \[0, 1\], got "):
        check_min_confidence(value)


def test_min_confidence_half_open_for_the_orchestrator() -> None:
    assert check_min_confidence(0.99, "speculation.min_confidence", allow_one=False) == 0.99
    with pytest.raises(InvalidArgument, match=r"^speculation.min_confidence must be in \[0, 1\), got 1.0$"):
        check_min_confidence(1.0, "speculation.min_confidence", allow_one=False)
