"""The router's membership routes, behind the deployment's admin token: an instance
joins (`pdd serve --join`), an operator drains one (`pdd drain`)."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request

from pdd.api.auth import ADMIN_PREFIX, RequireApiKey, admin_token
from pdd.api.protocol import ApiError
from pdd.config import ConfigError, Deployment, instance_from_dict
from pdd.router.members import Membership, MembershipError


def add_admin_routes(app: FastAPI, members: Membership, dep: Deployment) -> None:
    app.add_middleware(RequireApiKey, keys={"admin": admin_token(dep.secret)}, prefix=ADMIN_PREFIX)

    @app.post(ADMIN_PREFIX + "instances")
    async def join(request: Request) -> dict:
        try:
            spec = instance_from_dict(json.loads(await request.body()), dep.engine)
            joined = members.join(spec)
        except (ValueError, ConfigError) as e:  # (MembershipError, json's errors are ValueErrors)
            raise ApiError(409 if isinstance(e, MembershipError) else 400, str(e)) from None
        return {"name": spec.name, "joined": joined}

    @app.post(ADMIN_PREFIX + "instances/{name}/drain")
    async def drain(name: str) -> dict:
        try:
            await members.drain(name)
        except MembershipError as e:
            raise ApiError(404, str(e)) from None
        return {"name": name, "draining": True}
