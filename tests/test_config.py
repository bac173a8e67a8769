"""Addresses in the deployment file: an instance is reached where it listens, from
every datacenter, unless it advertises another address to a datacenter (a NAT, a
public address, or a `pdd line` hop, which is what `pdd up` puts on each route that
crosses its emulated line)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import replace

import pytest

from pdd import config as cfg
from pdd.lab.deploy import Launcher, resolve
from pdd.router.members import member
from pdd.transfer import messages as m
from pdd.transfer.wire import Frame, encode_json

TWO_SITES = """
mode = "pdd"
[router]
dc = "A"
host = "10.1.0.10"
[[instances]]
name = "p0"
role = "prefill"
dc = "A"
host = "10.1.0.11"
port = 8100
kv_port = 9100
[[instances]]
name = "md0"
role = "main"
dc = "B"
host = "0.0.0.0"
port = 8100
kv_port = 9100
advertise = { A = "203.0.113.7:19100", B = "10.2.0.10:9100" }
[[instances]]
name = "md1"
role = "main"
dc = "B"
host = "10.2.0.11"
port = 8100
kv_port = 9100
"""


def _parse(text: str) -> cfg.Deployment:
    return cfg.parse(tomllib.loads(text))


def test_an_instance_is_reached_at_its_own_address_across_the_line_unless_it_advertises_another():
    dep = _parse(TWO_SITES)
    md0, md1, p0 = dep.instance("md0"), dep.instance("md1"), dep.instance("p0")
    assert dep.address(md1, "A") == dep.address(md1, "B") == ("10.2.0.11", 9100)  # a routed line: nothing to say
    assert dep.address(p0, "B") == ("10.1.0.11", 9100)
    assert dep.address(md0, "A") == ("203.0.113.7", 19100)  # behind a NAT, seen from A
    assert dep.address(md0, "B") == ("10.2.0.10", 9100)


def test_a_wildcard_listener_must_say_where_it_is_reached():
    dep = _parse(TWO_SITES)
    md0 = replace(dep.instance("md0"), advertise={"A": "203.0.113.7:19100"})
    with pytest.raises(cfg.ConfigError, match=r"advertise\.B"):
        dep.address(md0, "B")
    router = replace(dep.router, host="0.0.0.0")
    with pytest.raises(cfg.ConfigError, match=r"\[router\] advertise"):
        _ = router.url
    assert replace(router, advertise="10.1.0.10:8000").url == "http://10.1.0.10:8000"
    assert dep.router.url == "http://10.1.0.10:8000"


@pytest.mark.parametrize("line, match", [
    ('advertise = { A = "no-port" }', r"advertise\.A"),
    ('advertise = { A = "h:0" }', r"advertise\.A"),
    ('advertise = { A = 9100 }', r"advertise\.A"),
    ('advertise = "h:1"', "advertise must be a table"),
    ('line_port = 9200', "unknown keys.*line_port"),
])
def test_bad_addresses_are_refused_by_name(line, match):
    with pytest.raises(cfg.ConfigError, match=match):
        _parse(TWO_SITES + line + "\n")
    with pytest.raises(cfg.ConfigError, match="advertise"):
        _parse(TWO_SITES.replace('[router]\n', '[router]\nadvertise = "nowhere"\n'))


def test_advertised_addresses_survive_the_file_a_join_and_the_member_frame():
    dep = _parse(TWO_SITES)
    assert _parse(cfg.dump(dep)).instances == dep.instances
    md0 = dep.instance("md0")
    assert cfg.instance_from_dict(cfg.instance_to_dict(md0), dep.engine) == md0  # `pdd serve --join`'s body
    body = m.decode(Frame(m.MsgType.MEMBER, 0, encode_json(m.to_dict(member(md0)))))
    assert body.advertise == md0.advertise


def test_pdd_up_puts_its_emulator_on_every_route_across_the_line_and_only_there(tiny_model_dir, tmp_path):
    dep = resolve(cfg.Deployment(), "pdd", 0)
    line = dep.line
    hops = {i.name: i.advertise for i in dep.instances}
    assert set(hops["md0"]) == {"A"} and not hops["p0"] and not hops["rld0"]
    md0 = dep.instance("md0")
    assert dep.address(md0, "A") == cfg.parse_addr(hops["md0"]["A"]) and hops["md0"]["A"].startswith(line.host)
    assert dep.address(md0, "B") == (md0.host, md0.kv_port)
    assert f"--route={hops['md0']['A']}={md0.host}:{md0.kv_port}" in Launcher(dep, tmp_path).emulator_args()
    assert line.admin_port
    same = resolve(cfg.Deployment(), "pd-same-dc", 0)
    assert not any(i.advertise for i in same.instances) and not same.line.admin_port


@pytest.mark.parametrize("text, match", [
    ('[line]\nbandwidth_mbps = "fast"', r"\[line\] bandwidth_mbps must be a number"),
    ("[engine]\nnum_pages = 2.5", r"\[engine\] num_pages must be an integer"),
    ("[policy]\ndecode_radix_cache = 1", r"\[policy\] decode_radix_cache must be true or false"),
    ("[slo]\nttft_ms = nan", r"\[slo\] ttft_ms must be a finite number"),
    ("[router]\nport = 80\nzzz = 1", r"\[router\] has unknown keys: \['zzz'\]"),
    ('colour = "red"', r"unknown top-level keys: \['colour'\]"),
    ("[model]\npath = 2024-01-01", r"\[model\] path must be a string"),
    ('[[instances]]\nname = "a"\nrole = "main"\n[instances.engine]\nnum_pages = "many"',
     r"\[instances\.a\] engine\.num_pages must be an integer"),
    ('[[instances]]\nname = "a"\nrole = "king"', r"\[instances\.a\] role must be one of"),
])
def test_a_bad_value_is_refused_naming_the_file_and_the_key(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    with pytest.raises(cfg.ConfigError, match=re.escape(str(path)) + ": " + match):
        cfg.load(path)


OLD_FILE = "[link]\nbandwidth_mbps = 80.0\ndelay_ms = 3.0\n"  # [line] under its retired name


def test_a_file_with_the_old_line_table_still_loads_and_is_told_the_new_name(tmp_path, caplog):
    path = tmp_path / "old.toml"
    path.write_text(OLD_FILE)
    with caplog.at_level("WARNING", logger="pdd.config"):
        dep = cfg.load(path)
    assert (dep.line.bandwidth_mbps, dep.line.delay_ms) == (80.0, 3.0)
    assert [r.getMessage() for r in caplog.records] == [
        f"[{cfg.OLD_LINE_TABLE}] is now called [line]: rename the table (read as [line] this time)"]
    path.write_text(OLD_FILE + "[line]\njitter_ms = 1.0\n")
    with pytest.raises(cfg.ConfigError, match=r"are one table: keep \[line\]"):
        cfg.load(path)


def test_an_instances_engine_table_overrides_the_deployments():
    dep = _parse('[engine]\nnum_pages = 100\nmax_running = 3\n'
                 '[[instances]]\nname = "md0"\nrole = "main"\n[instances.engine]\nnum_pages = 50\n')
    assert (dep.engine.num_pages, dep.engine.max_running) == (100, 3)
    assert (dep.instance("md0").engine.num_pages, dep.instance("md0").engine.max_running) == (50, 3)


@pytest.mark.parametrize("mode", cfg.MODES)
def test_every_resolved_deployment_round_trips_through_its_file(tiny_model_dir, mode):
    dep = resolve(cfg.Deployment(), mode, 0)
    assert _parse(cfg.dump(dep)) == dep


@pytest.mark.parametrize("mode", ["pdd", "pd-cross-dc"])
def test_a_launchs_ports_are_all_distinct_when_the_draw_repeats(tiny_model_dir, mode, monkeypatch):
    # A range of 24 ports: without the launch's own record of what it drew, some of its
    # 6-13 draws repeat (CI: p0's KV port drawn again as md0's HTTP port, which md0 held).
    monkeypatch.setattr("pdd.lab.launch._ephemeral_range", lambda: (1024 + 24, 60999))
    for _ in range(5):
        dep = resolve(cfg.Deployment(), mode, None)
        ports = [p for i in dep.instances for p in (i.port, i.kv_port)]
        ports += [int(a.rsplit(":", 1)[1]) for i in dep.instances for a in i.advertise.values()]
        ports += [dep.router.port] + ([dep.line.admin_port] if dep.line.admin_port else [])
        assert len(ports) == len(set(ports)) >= 7, ports


def test_the_secret_from_its_file(tmp_path):
    """`secret_file` (a Kubernetes Secret mounted): its content, stripped, is the secret; the
    file that names it dumps back naming it, not holding it; both at once, an empty or a
    missing file are refused by name."""
    (tmp_path / "secret").write_text("0123456789abcdef0123456789abcdef\n")
    (tmp_path / "d.toml").write_text(f'secret_file = "{tmp_path / "secret"}"\n')
    dep = cfg.load(tmp_path / "d.toml")
    assert dep.secret == "0123456789abcdef0123456789abcdef"
    dumped = cfg.dump(dep)
    assert dep.secret not in dumped and str(tmp_path / "secret") in dumped
    (tmp_path / "again.toml").write_text(dumped)
    assert cfg.load(tmp_path / "again.toml").secret == dep.secret
    (tmp_path / "empty").write_text("\n")
    refused = {f'secret = "x"\nsecret_file = "{tmp_path / "secret"}"\n': "both given",
               f'secret_file = "{tmp_path / "empty"}"\n': "is empty",
               f'secret_file = "{tmp_path / "nowhere"}"\n': "cannot read"}
    for text, said in refused.items():
        (tmp_path / "bad.toml").write_text(text)
        with pytest.raises(cfg.ConfigError, match=said):
            cfg.load(tmp_path / "bad.toml")
