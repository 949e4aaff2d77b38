"""perf.serve's arithmetic that runs without a GPU."""
from perf.serve import exposed_by_name, exposed_by_position


def test_exposed_time_is_the_critical_path_under_overlap():
    # b starts before a ends (PDL: it waits inside its span), c after an idle gap, a twice
    spans = [("a", 0.0, 10.0), ("b", 4.0, 13.0), ("c", 20.0, 25.0), ("a", 24.0, 30.0), ("d", 26.0, 28.0)]
    got = exposed_by_name(list(reversed(spans)))  # order given does not matter: sorted by start
    assert got == {"a": (10.0 + 5.0, 2), "b": (3.0, 1), "c": (5.0, 1), "d": (0.0, 1)}
    assert sum(t for t, _ in got.values()) == 10 + 3 + 5 + 5  # the union of the spans, gaps excluded


def test_exposed_by_position_takes_the_repeating_unit():
    # two units "q a b" (b launched 2 us before a ends), then a shorter one ("q lm": the step's tail) left out
    spans = [("q", 0.0, 1.0), ("a", 1.0, 5.0), ("b", 3.0, 6.0),
             ("q", 6.0, 8.0), ("a", 8.0, 11.0), ("b", 9.0, 14.0), ("q", 14.0, 15.0), ("lm", 15.0, 20.0),
             ("q", 21.0, 22.0)]
    got = exposed_by_position(spans, ("q",))
    assert [op["name"] for op in got] == ["q", "a", "b"] and got[0]["units"] == 2
    assert [op["exposed"] for op in got] == [1.5, 3.5, 2.0]
    assert [op["span"] for op in got] == [1.5, 3.5, 4.0]
    assert [op["lead"] for op in got] == [0.0, 0.0, 2.0]
    assert exposed_by_position(spans, ("none",)) == []
    other_first = [("x" if i == 3 else n, a, b) for i, (n, a, b) in enumerate(spans)]  # either name starts a unit
    assert [op["name"] for op in exposed_by_position(other_first, ("q", "x"))] == ["q", "a", "b"]
