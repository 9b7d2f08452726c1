"""The registry's key layout; the only place that spells keys (docs/registry.md mirrors it).

/cpn/v1/sites/<site>/spec        SiteSpec                      written by `cpn site join`
/cpn/v1/sites/<site>/cordon      Cordon                        written by `cpn site leave`
/cpn/v1/sites/<site>/status      SiteStatus       (lease)      agent, every interval
/cpn/v1/sites/<site>/last_seen   LastSeen                      agent, with every status
/cpn/v1/agents/<site>            AgentRecord      (lease)      agent; the per-site agent lock
/cpn/v1/links/<src>/<dst>        LinkStatus       (lease)      agent of src, every interval
/cpn/v1/services/<svc>/<site>    ServiceEndpoint  (lease)      agent, every interval
/cpn/v1/assignments/<site>/<job> (broker)                      jobs placed on the site
/cpn/v1/gangs/<tenant>/<gang>    GangRecord                    broker, at each member's submit
"""

from __future__ import annotations

ROOT = "/cpn/v1/"
SITES = ROOT + "sites/"
AGENTS = ROOT + "agents/"
LINKS = ROOT + "links/"
SERVICES = ROOT + "services/"
ASSIGNMENTS = ROOT + "assignments/"
REPORTS = ROOT + "reports/"
JOBS = ROOT + "jobs/"
LEADER = ROOT + "leader"


def site_spec(site: str) -> str:
    return f"{SITES}{site}/spec"


def site_cordon(site: str) -> str:
    return f"{SITES}{site}/cordon"


def site_status(site: str) -> str:
    return f"{SITES}{site}/status"


def site_last_seen(site: str) -> str:
    return f"{SITES}{site}/last_seen"


def agent(site: str) -> str:
    return f"{AGENTS}{site}"


def link(src: str, dst: str) -> str:
    return f"{LINKS}{src}/{dst}"


def service(name: str, site: str) -> str:
    return f"{SERVICES}{name}/{site}"


def assignments(site: str) -> str:
    return f"{ASSIGNMENTS}{site}/"


def assignment(site: str, job: str) -> str:
    return f"{ASSIGNMENTS}{site}/{job}"


def reports(site: str) -> str:
    return f"{REPORTS}{site}/"


def report(site: str, job: str) -> str:
    return f"{REPORTS}{site}/{job}"


def job(job_id: str) -> str:
    return f"{JOBS}{job_id}"


def split(key: str, prefix: str) -> list[str]:
    """The parts of `key` after `prefix`: split('/cpn/v1/links/a/b', LINKS) == ['a', 'b']."""
    if not key.startswith(prefix):
        raise ValueError(f"key {key!r} is not under {prefix!r}")
    return key[len(prefix) :].split("/")


GANGS = ROOT + "gangs/"


def gang(tenant: str, name: str) -> str:
    """/cpn/v1/gangs/<tenant>/<gang>: the gang's size, shape and members (broker, at submit)."""
    return f"{GANGS}{tenant}/{name}"
