"""The page-lifetime race scenario's parts that need no server: verdicts, shaping, parsing, detection."""

from __future__ import annotations

import pytest

from backport.live import netns, race

SS = """State Recv-Q Send-Q Local Address:Port Peer Address:Port Process
ESTAB 0      0          127.0.0.1:40961   127.0.0.1:5555
\t cubic wscale:7,7 rto:201 bytes_sent:1204 bytes_acked:1204 bytes_received:88
ESTAB 0      0          127.0.0.1:40962   127.0.0.1:17001
\t cubic wscale:7,7 rto:201 bytes_sent:524400 bytes_acked:524400 segs_out:360
ESTAB 0      0          127.0.0.1:50123   127.0.0.1:17001
\t cubic wscale:7,7 rto:201 bytes_sent:9999999 bytes_acked:9999999
ESTAB 0      0          127.0.0.1:17001   127.0.0.1:40962
\t cubic wscale:7,7 rto:201 bytes_received:524400
"""


def test_busiest_connection_from_a_port_block_names_the_data_port():
    assert netns.busiest_connection(SS, netns.A_PORTS) == (17001, 524400)
    assert netns.busiest_connection(SS, (30000, 30010)) is None


def test_port_block_is_what_the_mask_matches():
    low, high = netns.A_PORTS
    assert low & netns.A_PORT_MASK == low and (high & netns.A_PORT_MASK) == low
    assert (high + 1) & netns.A_PORT_MASK != low and (low - 1) & netns.A_PORT_MASK != low
    other = netns.OTHER_RANGE
    assert other[0] > high or other[1] < low   # the rest never falls into A's block


def test_shaping_commands_match_only_a_to_decode_data_port():
    commands = netns.Shaping(17001, "3mbit").commands()
    assert commands[0][:6] == ["tc", "qdisc", "replace", "dev", "lo", "root"] and commands[0][-1] == "htb"
    assert commands[1][-4:] == ["rate", "3mbit", "ceil", "3mbit"]
    flt = " ".join(commands[2])
    assert "match ip dport 17001 0xffff" in flt
    assert f"match ip sport {netns.A_PORTS[0]} 0xfc00" in flt and flt.endswith(f"flowid {netns.SHAPED_CLASS}")


def test_class_byte_counter_parsed():
    text = ("class htb 1:10 root prio 0 rate 3Mbit ceil 3Mbit burst 1599b cburst 1599b \n"
            " Sent 491520 bytes 340 pkt (dropped 0, overlimits 12 requeues 0) \n")
    assert netns.parse_class_bytes(text) == 491520
    with pytest.raises(ValueError):
        netns.parse_class_bytes("nothing")


def _trial(matches: bool, invalid: str | None = None, wait: float = 1.0) -> dict:
    out = {"b_matches_reference": matches, "b_wait_seconds": wait}
    if invalid:
        out["invalid"] = invalid
    return out


SAFE_CONTROLS = {"b_alone": _trial(True), "held_back": _trial(True)}


def test_judge_counts_unsafe_valid_trials():
    verdict, observed = race.judge(
        SAFE_CONTROLS, [_trial(False), _trial(True), _trial(False, "A not shaped")]
    )
    assert verdict == race.UNSAFE and observed.startswith("1 of 2 valid trials unsafe (3 run)")


def test_judge_safe_when_every_valid_trial_matches():
    verdict, observed = race.judge(SAFE_CONTROLS, [_trial(True, wait=18.2), _trial(True, wait=21.0)])
    assert verdict == race.SAFE and "0 of 2" in observed and "18.2 - 21.0 s" in observed


@pytest.mark.parametrize("control", ["b_alone", "held_back"])
def test_judge_error_when_a_control_is_not_safe(control):
    controls = {**SAFE_CONTROLS, control: _trial(False)}
    verdict, observed = race.judge(controls, [_trial(False)])
    assert verdict == race.ERROR and control in observed


def test_judge_error_when_the_held_back_control_held_nothing():
    controls = {**SAFE_CONTROLS, "held_back": _trial(True, "A's shaped flow never reached the abort point")}
    verdict, observed = race.judge(controls, [_trial(False)])
    assert verdict == race.ERROR and "held_back" in observed and "not valid" in observed


def test_a_hold_that_let_a_s_writes_through_is_no_control():
    """Counted from the hold taking effect (the bytes that passed while tc changed the rate are
    before it): 5% of A's KV or more through the held class and the control proves nothing."""
    assert race.hold_leak({"hold_from_fraction": 0.14, "a_fraction_during_hold": 0.15}) is None
    why = race.hold_leak({"hold_from_fraction": 0.10, "a_fraction_during_hold": 0.31})
    assert why and "0.210" in why
    controls = {**SAFE_CONTROLS, "held_back": _trial(True, why)}
    verdict, observed = race.judge(controls, [_trial(False)])
    assert verdict == race.ERROR and "not held back" in observed


def _served_whole(matches: bool = True) -> dict:
    """A trial in which decode's abort did not end A (A answered 200 after it)."""
    return {**_trial(matches, wait=14.2), "a_decode_status": 200}


def test_judge_not_applicable_where_decode_cannot_abort_a_transfer():
    """0.4.6.post5 live: A answered 200 after decode's abort in every trial (its KV fully sent), B waited
    for A's pages and was right, and the held-back control's B timed out waiting for the held A."""
    controls = {**SAFE_CONTROLS, "held_back": {**_trial(False, "B got status None: ReadTimeout"),
                                               "a_decode_status": None}}
    verdict, observed = race.judge(controls, [_served_whole(), _served_whole(), _served_whole()])
    assert verdict == race.NOT_APPLICABLE and "never ended A" in observed and "3 valid" in observed
    # 0.4.10.post2 live: the abort reached A's transfer (decode logged its failure, then held the pages),
    # yet A still answered 200 (an aborted request's status there): judged as before, never not-applicable
    failed = ["[2026-12-07 10:55:50] Decode transfer failed for request rank=0 decode_req.req.rid='a-12' "
              "... Aborted by AbortReq."]
    verdict, observed = race.judge(SAFE_CONTROLS, [_served_whole(), _served_whole()], failed)
    assert verdict == race.SAFE and "0 of 2" in observed
    # a wrong B is never explained away, and a trial where the abort took effect is judged as before
    assert race.judge(controls, [_served_whole(), _served_whole(False)])[0] == race.ERROR
    assert race.judge(SAFE_CONTROLS, [_served_whole(), _trial(False)])[0] == race.UNSAFE
    broken_alone = {**controls, "b_alone": _trial(False)}
    assert race.judge(broken_alone, [_served_whole()])[0] == race.ERROR


def test_judge_error_without_a_valid_trial():
    verdict, observed = race.judge(SAFE_CONTROLS, [_trial(False, "A's flow never reached the abort point")])
    assert verdict == race.ERROR and "no valid trial of 1" in observed


def test_not_applicable_names_the_missing_tool(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    assert "`tc` not found" in netns.unavailable()


def test_not_applicable_when_no_namespace_can_be_made(monkeypatch, tmp_path):
    monkeypatch.setattr(netns.shutil, "which", lambda tool: "/usr/sbin/" + tool)

    def refuse(flags):
        return -1

    monkeypatch.setattr(netns, "_libc", type("L", (), {"unshare": staticmethod(refuse),
                                                       "setns": staticmethod(refuse)})())
    reason = netns.unavailable()
    assert reason.startswith("no private network namespace")


def test_run_race_is_not_applicable_without_touching_a_server(monkeypatch, tmp_path):
    monkeypatch.setattr(netns, "unavailable", lambda: "`tc` not found (Debian's iproute2)")
    result = race.run_race(None, tmp_path, tmp_path)
    assert result["scenario"] == "aborted_transfer_pages_not_reused"
    assert result["verdict"] == race.NOT_APPLICABLE and "iproute2" in result["observed"]
