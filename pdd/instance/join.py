"""`pdd serve --join`: an instance registers with a running router.

The router then connects to it, health-checks it by heartbeats and tells the other
instances where it is (`pdd.router.members`). Registration is retried while the router
is unreachable, since instance and router may start in any order.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from pdd.api.auth import ADMIN_PREFIX, admin_token
from pdd.config import Deployment, InstanceSpec, instance_to_dict

log = logging.getLogger(__name__)
RETRY_S = 1.0
ATTEMPTS = 120


async def register(dep: Deployment, spec: InstanceSpec) -> bool:
    """Register `spec` with the router of `dep`; whether the router took it."""
    url = f"{dep.router.url}{ADMIN_PREFIX}instances"
    headers = {"Authorization": f"Bearer {admin_token(dep.secret)}"}
    async with httpx.AsyncClient(timeout=10.0) as client:
        for _ in range(ATTEMPTS):
            try:
                r = await client.post(url, json=instance_to_dict(spec), headers=headers)
            except httpx.HTTPError as e:
                log.info("router at %s not reachable yet (%s); retrying", url, e)
                await asyncio.sleep(RETRY_S)
                continue
            if r.status_code == 200:
                log.info("joined the deployment: %s", r.json())
                return True
            log.error("the router refused to add %s: %s %s", spec.name, r.status_code, r.text)
            return False
    log.error("gave up registering %s with the router at %s", spec.name, url)
    return False
