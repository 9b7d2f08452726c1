"""The registry's key layout; the only place that spells keys (docs/registry.md mirrors it).

/cpn/v1/sites/<site>/spec        SiteSpec                      written by `cpn site join`
/cpn/v1/sites/<site>/cordon      Cordon                        written by `cpn site leave`
/cpn/v1/sites/<site>/status      SiteStatus       (lease)      agent, every interval
/cpn/v1/sites/<site>/last_seen   LastSeen                      agent, with every status
/cpn/v1/sites/<site>/prices      PriceHistory                  `cpn site join`, with the spec
/cpn/v1/agents/<site>            AgentRecord      (lease)      agent; the per-site agent lock
/cpn/v1/agent-secrets/<site>     AgentSecret      (lease)      agent: the bearer its /jobs ask
/cpn/v1/links/<src>/<dst>        LinkStatus       (lease)      agent of src, every interval
/cpn/v1/services/<svc>/<site>    ServiceEndpoint  (lease)      agent, every interval: a service
                                                               the site file declares
/cpn/v1/replicas/<site>/<svc>/<job>  ServiceEndpoint (lease)   agent, every interval: one replica
                                                               of a managed service (its job); the
                                                               site first, so one prefix grant
                                                               covers a site's replicas
/cpn/v1/assignments/<site>/<job> (broker)                      jobs placed on the site
/cpn/v1/gangs/<tenant>/<gang>    GangRecord                    broker, at each member's submit
/cpn/v1/workflows/<id>           WorkflowRecord                broker: the DAG, each step's job
/cpn/v1/index/workflows/<inv>/<id>                 WorkflowSummary  broker, at submit
/cpn/v1/index/tenants/<tenant>/workflows/<inv>/<id> WorkflowSummary broker, at submit
/cpn/v1/jobs/<id>                JobRecord                     broker: the hot record
/cpn/v1/index/jobs/<inv>/<id>    JobSummary                    broker, with every job write
/cpn/v1/index/history/<inv>/<id> JobSummary                    broker, when it archives a job
/cpn/v1/index/finished/<ts>/<id> ""                            broker, when a job finishes
/cpn/v1/index/tenants/<tenant>/jobs/<inv>/<id>     JobSummary  broker, with every job write
/cpn/v1/index/tenants/<tenant>/history/<inv>/<id>  JobSummary  broker, when it archives a job
/cpn/v1/index/live/<inv>/<id>    JobSummary                    broker, while a job is unfinished
/cpn/v1/index/states/<STATE>/<inv>/<id>            ""          broker, when a job finishes
/cpn/v1/index/history-states/<STATE>/<inv>/<id>    ""          broker, when it archives a job
/cpn/v1/index/tenants/<tenant>/{live,states/<STATE>,history-states/<STATE>}/<inv>/<id>
                                                   the same    the same, per tenant
/cpn/v1/history/jobs/<id>        zlib(JobRecord)               broker, when it archives a job
/cpn/v1/migrations/<name>        {"done_at": ...}              broker, once per migration
/cpn/v1/schema                   Schema                        broker: the layout it holds
/cpn/v1/tokens/<id>              TokenRecord (hash only)       broker or `cpn token create`
/cpn/v1/audit/<inv>/<id>         AuditEntry                    broker, for every change
/cpn/v1/usage/segments/<day>/<job>/<attempt>  Segment          broker, when a run ends
/cpn/v1/usage/rollups/<day>/<part>           Rollup           leader: closed days' segments
/cpn/v1/history/usage/<day>/<job>/<attempt>  Segment          leader, with the rollup
/cpn/v1/alerts/<rule>/<subject...>           AlertRecord      leader: firing or resolved
/cpn/v1/alerts-outbox/<us>/<webhook>/<id>    Notification     leader, with the state change
/cpn/v1/service-specs/<svc>      ServiceRecord                 broker: `cpn service apply`, and
                                                               the leader's replica reconciler
/cpn/v1/index/services/<svc>     ServiceSummary                broker, with the service record
/cpn/v1/index/tenants/<tenant>/services/<svc>     ServiceSummary  broker, with it too
/cpn/v1/scaling/<svc>            ScalingDecision               leader's autoscaler: replicas
                                                               per client region
                                                               (broker.model.services)
/cpn/v1/autoscaler/<svc>         AutoscalerRecord              leader's autoscaler: its delays in
                                                               progress (broker.leader.scaler)
/cpn/v1/datasets/<tenant>/<name>/meta          DatasetMeta     broker: owner, shares, the latest
                                                               version (broker.model.datasets)
/cpn/v1/datasets/<tenant>/<name>/v/<version>   DatasetVersion  broker: digest, size, files count,
                                                               made by (a put or a job)
/cpn/v1/index/datasets/<tenant>/<name>             ""          broker: every dataset, by owner
/cpn/v1/index/tenants/<t>/datasets/<owner>/<name>  ""          broker: the datasets tenant t owns
                                                               or is shared (`cpn data ls`)
/cpn/v1/data-refs/<digest>/<tenant>/<name>/<version>  ""       broker, with each version: who
                                                               still names a manifest
/cpn/v1/data-manifests/<digest>  zlib(Manifest)                broker, with the first version
                                                               naming it (read one at a time)
/cpn/v1/data-replicas/<site>/<digest>  ReplicaRecord           agent of the site: it holds the
                                                               manifest complete (not leased:
                                                               a store outlives its agent)
/cpn/v1/data-outbox/<job>/<attempt>    DataOutbox              leader, with a run's end: its outputs
                                                               to register and its egress to bill
                                                               (broker.leader.data_outbox)
/cpn/v1/data-orders/<site>/<digest>    ReplicationOrder        broker: `cpn data replicate`; the
                                                               site's agent pulls, then writes
                                                               its replica record
/cpn/v1/traffic/<instance>       TrafficSummary   (lease)      every broker replica: its gateway's
                                                               requests and TTFB per service and
                                                               client region (broker.state.traffic)

<day> is the UTC date a run ended (YYYY-MM-DD), so a day's or a month's segments are one range.
<inv> is the job's creation time inverted (broker.state.store.position), so etcd's key order
is newest first; <ts> is a finish time in microseconds, so the oldest finished comes first.
"""

from __future__ import annotations

ROOT = "/cpn/v1/"
SITES = ROOT + "sites/"
AGENTS = ROOT + "agents/"
AGENT_SECRETS = ROOT + "agent-secrets/"
LINKS = ROOT + "links/"
SERVICES = ROOT + "services/"
REPLICAS = ROOT + "replicas/"
# what a registry snapshot (sites.model.snapshot.Snapshot) is made of
SNAPSHOT = (SITES, AGENTS, LINKS, SERVICES, REPLICAS)
ASSIGNMENTS = ROOT + "assignments/"
REPORTS = ROOT + "reports/"
JOBS = ROOT + "jobs/"
LEADER = ROOT + "leader"
JOB_INDEX = ROOT + "index/jobs/"
HISTORY_INDEX = ROOT + "index/history/"
FINISHED_INDEX = ROOT + "index/finished/"
HISTORY = ROOT + "history/jobs/"
MIGRATIONS = ROOT + "migrations/"
SCHEMA = ROOT + "schema"  # the layout the registry holds (sites.model.schema)
TOKENS = ROOT + "tokens/"
CRL = ROOT + "pki/crl"  # the CA's revocation list (PEM): `cpn certs revoke --publish` puts it
TENANCY = ROOT + "tenancy/"  # cohorts, priority classes, tenants, fair-share levels
TENANCY_CONFIG = TENANCY + "config"  # cohorts, priority classes, fair_share, preemption
TENANCY_TENANTS = TENANCY + "tenants/"
FAIR_SHARE = TENANCY + "fair-share"  # decayed usage per tenant, written by the leader
AUDIT = ROOT + "audit/"
DATASETS = ROOT + "datasets/"
DATA_MANIFESTS = ROOT + "data-manifests/"
DATA_REPLICAS = ROOT + "data-replicas/"
DATA_ORDERS = ROOT + "data-orders/"
DATA_OUTBOX = ROOT + "data-outbox/"
DATASET_INDEX = ROOT + "index/datasets/"
DATA_REFS = ROOT + "data-refs/"


def site_spec(site: str) -> str:
    return f"{SITES}{site}/spec"


def site_cordon(site: str) -> str:
    return f"{SITES}{site}/cordon"


def site_status(site: str) -> str:
    return f"{SITES}{site}/status"


def site_prices(site: str) -> str:
    return f"{SITES}{site}/prices"


def site_last_seen(site: str) -> str:
    return f"{SITES}{site}/last_seen"


def agent(site: str) -> str:
    return f"{AGENTS}{site}"


def agent_secret(site: str) -> str:
    return f"{AGENT_SECRETS}{site}"


def link(src: str, dst: str) -> str:
    return f"{LINKS}{src}/{dst}"


def service(name: str, site: str) -> str:
    """A site's own endpoint of a service: one its site file declares (and, before a managed
    service could have several replicas at a site, its one replica's; still read as such)."""
    return f"{SERVICES}{name}/{site}"


def service_replica(name: str, site: str, job: str) -> str:
    """One replica's endpoint of a managed service: several replicas may run at one site.
    Under the site, not the service, so that the site's etcd role holds one prefix for all the
    replicas the broker may ever place there (sites.registry.security.site_grants)."""
    return f"{REPLICAS}{site}/{name}/{job}"


def site_replicas(site: str) -> str:
    """The prefix of every managed replica's endpoint at `site`."""
    return f"{REPLICAS}{site}/"


def service_endpoint(name: str, site: str, job: str | None) -> str:
    """The key of an endpoint: a replica's (`job` given) or the site's own (`service`)."""
    return service(name, site) if job is None else service_replica(name, site, job)


def assignments(site: str) -> str:
    return f"{ASSIGNMENTS}{site}/"


def assignment(site: str, job: str) -> str:
    return f"{ASSIGNMENTS}{site}/{job}"


def reports(site: str) -> str:
    return f"{REPORTS}{site}/"


# the registry was restored from a backup (sites.model.recovery, docs/backup.md): the record of
# the recovery, and a mark among each site's assignments, seen by its agent in the same read
RECOVERY = ROOT + "recovery"
RESTORE_MARK = "~restored"


def restore_mark(site: str) -> str:
    return f"{ASSIGNMENTS}{site}/{RESTORE_MARK}"


def report(site: str, job: str) -> str:
    return f"{REPORTS}{site}/{job}"


LATE = "~"  # no job id has one (JOB_ID_RE)


def late_report(site: str, job: str, attempt: int) -> str:
    """A run's end said after the broker moved on (its site lost meanwhile): beside the job's
    own report, which a later attempt at the same site may already hold; the leader bills the
    run to it and deletes it (broker.ops.usage_segments.amend_lost)."""
    return f"{REPORTS}{site}/{job}{LATE}{attempt}"


def job(job_id: str) -> str:
    return f"{JOBS}{job_id}"


def job_index(position: str, job_id: str) -> str:
    """A hot job's entry in the newest-first index; `position` from broker.state.store."""
    return f"{JOB_INDEX}{position}/{job_id}"


def history_index(position: str, job_id: str) -> str:
    """An archived job's entry in the newest-first history index."""
    return f"{HISTORY_INDEX}{position}/{job_id}"


TENANT_INDEX = ROOT + "index/tenants/"


def tenant_jobs(tenant: str) -> str:
    """The prefix of one tenant's newest-first index of hot jobs: a tenant's list pages read
    only its own entries, however many jobs the others have."""
    return f"{TENANT_INDEX}{tenant}/jobs/"


def tenant_history(tenant: str) -> str:
    """The prefix of one tenant's newest-first index of archived jobs."""
    return f"{TENANT_INDEX}{tenant}/history/"


def tenant_job(tenant: str, position: str, job_id: str) -> str:
    """A hot job's entry in its tenant's own index (as job_index's)."""
    return f"{tenant_jobs(tenant)}{position}/{job_id}"


def tenant_archived(tenant: str, position: str, job_id: str) -> str:
    """An archived job's entry in its tenant's own history index (as history_index's)."""
    return f"{tenant_history(tenant)}{position}/{job_id}"


LIVE_INDEX = ROOT + "index/live/"
STATE_INDEX = ROOT + "index/states/"
HISTORY_STATE_INDEX = ROOT + "index/history-states/"


def live_jobs(tenant: str | None = None) -> str:
    """The prefix of the newest-first index of unfinished jobs (all tenants', or one's): a
    list of running or pending jobs reads only them, however long the history."""
    return LIVE_INDEX if tenant is None else f"{TENANT_INDEX}{tenant}/live/"


def state_jobs(state: str, tenant: str | None = None, *, archived: bool = False) -> str:
    """The prefix of the newest-first index of the jobs that ended in `state` (a terminal
    state: a job never leaves it, so its entry is written once), hot or archived."""
    if tenant is None:
        return f"{HISTORY_STATE_INDEX if archived else STATE_INDEX}{state}/"
    return f"{TENANT_INDEX}{tenant}/{'history-states' if archived else 'states'}/{state}/"


def finished(finished_us: int, job_id: str) -> str:
    """A finished job waiting to be archived, oldest first."""
    return f"{FINISHED_INDEX}{finished_us:017d}/{job_id}"


def archived_job(job_id: str) -> str:
    return f"{HISTORY}{job_id}"


def migration(name: str) -> str:
    return f"{MIGRATIONS}{name}"


def tenant_policy(tenant: str) -> str:
    return TENANCY_TENANTS + tenant


def token(token_id: str) -> str:
    return f"{TOKENS}{token_id}"


def audit(position: str, entry_id: str) -> str:
    """An audit entry, newest first (`position` as a job's in the index)."""
    return f"{AUDIT}{position}/{entry_id}"


def split(key: str, prefix: str) -> list[str]:
    """The parts of `key` after `prefix`: split('/cpn/v1/links/a/b', LINKS) == ['a', 'b']."""
    if not key.startswith(prefix):
        raise ValueError(f"key {key!r} is not under {prefix!r}")
    return key[len(prefix) :].split("/")


GANGS = ROOT + "gangs/"


def gang(tenant: str, name: str) -> str:
    """/cpn/v1/gangs/<tenant>/<gang>: the gang's size, shape and members (broker, at submit)."""
    return f"{GANGS}{tenant}/{name}"


WORKFLOWS = ROOT + "workflows/"
WORKFLOW_INDEX = ROOT + "index/workflows/"


def workflow(workflow_id: str) -> str:
    """/cpn/v1/workflows/<id>: a workflow's DAG and its steps' job ids (broker.model.workflows)."""
    return f"{WORKFLOWS}{workflow_id}"


def workflow_index(position: str, workflow_id: str) -> str:
    """A workflow's entry in the newest-first index of every workflow."""
    return f"{WORKFLOW_INDEX}{position}/{workflow_id}"


def tenant_workflows(tenant: str) -> str:
    """The prefix of one tenant's newest-first index of workflows."""
    return f"{TENANT_INDEX}{tenant}/workflows/"


def tenant_workflow(tenant: str, position: str, workflow_id: str) -> str:
    """A workflow's entry in its tenant's own index (as tenant_job's)."""
    return f"{tenant_workflows(tenant)}{position}/{workflow_id}"


USAGE = ROOT + "usage/"
USAGE_SEGMENTS = USAGE + "segments/"
USAGE_ROLLUPS = USAGE + "rollups/"
USAGE_HISTORY = ROOT + "history/usage/"


def usage_segment(day: str, job_id: str, attempt: int) -> str:
    """/cpn/v1/usage/segments/<day>/<job>/<attempt>: one run's metered use (metering.ledger),
    written in the transaction that ends the run; `day` the UTC date it ended (YYYY-MM-DD)."""
    return f"{USAGE_SEGMENTS}{day}/{job_id}/{attempt:06d}"


def usage_rollup(day: str, part: str) -> str:
    """/cpn/v1/usage/rollups/<day>/<part>: the summed rows of up to ROLLUP_SEGMENTS segments
    of a closed day (metering.rollup), which moved to USAGE_HISTORY in the same transaction."""
    return f"{USAGE_ROLLUPS}{day}/{part}"


def archived_segment(segment_key: str) -> str:
    """Where a rolled-up segment is kept (its detail, for exports), same <day>/<job>/<attempt>."""
    return USAGE_HISTORY + segment_key.removeprefix(USAGE_SEGMENTS)


USAGE_TOKENS = USAGE + "tokens/"


def usage_tokens(day: str, tenant: str, writer: str) -> str:
    """/cpn/v1/usage/tokens/<day>/<tenant>/<writer>: one broker replica's inference tokens for
    one tenant on one UTC day (metering.tokens.TokenDay), summed by (model, site, client
    region); only that replica writes it, each flush guarded on its mod_revision."""
    return f"{USAGE_TOKENS}{day}/{tenant}/{writer}"


INFERENCE_LIMITS = ROOT + "inference-limits/"


def inference_limit(tenant: str, writer: str) -> str:
    """/cpn/v1/inference-limits/<tenant>/<writer>: what one broker replica admitted and charged
    for a tenant lately (its requests and tokens per recent second, its month's tokens and
    USD): every replica reads all of them, so a limit holds across replicas together."""
    return f"{INFERENCE_LIMITS}{tenant}/{writer}"


ALERTS = ROOT + "alerts/"
ALERTS_OUTBOX = ROOT + "alerts-outbox/"


def alert(rule: str, subject: tuple[str, ...]) -> str:
    """/cpn/v1/alerts/<rule>/<subject...>: one alert's state (broker.leader.alerts), firing or
    resolved; the subject is a site, a link (src/dst), a tenant or a service/site."""
    return "/".join((ALERTS + rule, *subject))


def alert_outbox(created_us: int, webhook: str, notification_id: str) -> str:
    """/cpn/v1/alerts-outbox/<us>/<webhook>/<id>: a notification not yet delivered to
    `webhook`, written in the transaction that changed the alert; oldest first."""
    return f"{ALERTS_OUTBOX}{created_us:017d}/{webhook}/{notification_id}"


SERVICE_SPECS = ROOT + "service-specs/"
SCALING = ROOT + "scaling/"


def service_spec(name: str) -> str:
    """/cpn/v1/service-specs/<svc>: a managed service's spec, its replicas and its last scaling
    events (broker.model.services.ServiceRecord). Not under SERVICES, whose keys are endpoints."""
    return f"{SERVICE_SPECS}{name}"


def scaling(name: str) -> str:
    """/cpn/v1/scaling/<svc>: the autoscaler's last decision for the service
    (broker.model.services.ScalingDecision), which the replica reconciler carries out."""
    return f"{SCALING}{name}"


AUTOSCALER = ROOT + "autoscaler/"
TRAFFIC = ROOT + "traffic/"


def autoscaler_state(name: str) -> str:
    """/cpn/v1/autoscaler/<svc>: the autoscaler's state for the service (its delays in
    progress), so that a new leader goes on from it (broker.leader.scaler.AutoscalerRecord)."""
    return f"{AUTOSCALER}{name}"


def traffic(instance: str) -> str:
    """/cpn/v1/traffic/<instance>: one broker replica's gateway traffic, under its lease
    (broker.state.traffic.TrafficSummary)."""
    return f"{TRAFFIC}{instance}"


SERVICE_INDEX = ROOT + "index/services/"


def service_index(name: str) -> str:
    """A managed service's entry in the index of every service, by name."""
    return f"{SERVICE_INDEX}{name}"


def tenant_services(tenant: str) -> str:
    """The prefix of one tenant's index of managed services: its list reads only its own."""
    return f"{TENANT_INDEX}{tenant}/services/"


def tenant_service(tenant: str, name: str) -> str:
    return f"{tenant_services(tenant)}{name}"


def dataset_meta(tenant: str, name: str) -> str:
    return f"{DATASETS}{tenant}/{name}/meta"


def dataset_versions(tenant: str, name: str) -> str:
    """The prefix of a dataset's versions, oldest first (zero-padded)."""
    return f"{DATASETS}{tenant}/{name}/v/"


def dataset_version(tenant: str, name: str, version: int) -> str:
    return f"{dataset_versions(tenant, name)}{version:08d}"


def data_manifest(digest: str) -> str:
    return f"{DATA_MANIFESTS}{digest}"


def data_replicas(site: str) -> str:
    return f"{DATA_REPLICAS}{site}/"


def data_replica(site: str, digest: str) -> str:
    return f"{DATA_REPLICAS}{site}/{digest}"


def data_orders(site: str) -> str:
    return f"{DATA_ORDERS}{site}/"


def data_order(site: str, digest: str) -> str:
    return f"{DATA_ORDERS}{site}/{digest}"


def dataset_index(tenant: str, name: str) -> str:
    """A dataset's entry in the index of every dataset (an admin's `cpn data ls`)."""
    return f"{DATASET_INDEX}{tenant}/{name}"


def tenant_datasets(tenant: str) -> str:
    """The prefix of the datasets `tenant` owns or is shared: its list reads only those."""
    return f"{TENANT_INDEX}{tenant}/datasets/"


def tenant_dataset(tenant: str, owner: str, name: str) -> str:
    return f"{tenant_datasets(tenant)}{owner}/{name}"


def data_refs(digest: str) -> str:
    """The prefix of the versions naming a manifest: none left, its replicas may go."""
    return f"{DATA_REFS}{digest}/"


def data_ref(digest: str, tenant: str, name: str, version: int) -> str:
    return f"{data_refs(digest)}{tenant}/{name}/{version:08d}"


def data_outbox(job: str, attempt: int) -> str:
    return f"{DATA_OUTBOX}{job}/{attempt:06d}"
