"""What a Ray deployment of the service is made of, as the command line gives it: the replicas' contents
(`ReplicaSpec`) and their number and size (`Scaling`). Kept apart from the deployment itself
(cann_llm/runtime/serving/ray_app.py) so that reading the flags does not import Ray, whose settings (its token
authentication) are read once, when it is imported."""

from __future__ import annotations

from dataclasses import dataclass, field

from cann_llm.runtime.serving.server import ServerSettings


# how the ingress picks a replica: by cached prefix (the default), or the baselines it is measured against:
# Ray Serve's own default (the less loaded of two random replicas) and strict rotation
ROUTERS = {
    "prefix": "cann_llm.runtime.serving.prefix_router:PrefixAffinityRouter",
    "pow2": None,  # Ray Serve's default router
    "round_robin": "cann_llm.runtime.serving.prefix_router:RoundRobinRouter",
}


@dataclass
class ReplicaSpec:
    """What every replica is built from: the models (paths every node can read), the engine's settings given
    on the command line, the service's limits, and the keys and block list it checks."""

    models: dict[str, str]
    engine_overrides: dict = field(default_factory=dict)
    settings: ServerSettings = field(default_factory=ServerSettings)
    api_keys: list[str] = field(default_factory=list)
    blocklist: str | None = None


@dataclass
class Scaling:
    """How many replicas and what each gets: a fixed count, or autoscaled between `min_replicas` and
    `max_replicas` on ongoing requests per replica; `cpus` per replica (its engine's threads)."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    cpus: float = 1.0
    router: str = "prefix"          # one of ROUTERS
    imbalanced_threshold: int = 8   # queue-length spread past which load outweighs a cached prefix

    def deployment_options(self, max_pending: int, models: int, target_ongoing: int) -> dict:
        """EngineReplica's `.options()`. A replica is sent at most as many requests as its server admits
        (`max_pending` per model, whatever they ask for: a /v1/models call waits in the queue rather than let a
        generation through that the replica would refuse), and the ingress queues up to one replica's worth
        more before answering 429 itself."""
        from ray.serve.config import RequestRouterConfig

        scale = ({"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                         "initial_replicas": self.min_replicas,
                                         "target_ongoing_requests": target_ongoing}}
                 if self.max_replicas else {"num_replicas": self.replicas})
        router = ROUTERS[self.router]
        kwargs = {"imbalanced_threshold": self.imbalanced_threshold} if self.router == "prefix" else {}
        return {**scale, "max_ongoing_requests": max_pending * models, "max_queued_requests": max_pending,
                "ray_actor_options": {"num_cpus": self.cpus},
                "health_check_period_s": 2, "health_check_timeout_s": 30,
                **({"request_router_config": RequestRouterConfig(request_router_class=router,
                                                                 request_router_kwargs=kwargs)} if router else {})}

    @property
    def most(self) -> int:
        return self.max_replicas or self.replicas
