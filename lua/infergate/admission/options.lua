-- Names shared by the admission modules: the shared dicts of API keys and local token
-- buckets, and the tenant of every request when auth is off. The admission options
-- themselves are read where they are used, under their names in infergate.toml:
-- infergate.core.config.get().auth / .limits / .admission / .deadlines (every default,
-- unit and range lives in controlplane/config/admission.py).
local _M = {}

-- Shared dict names; they must match the lua_shared_dict lines of infergate-http.conf.
_M.DICT_AUTH = "infergate_auth"          -- valid keys
_M.DICT_AUTH_NEG = "infergate_auth_neg"  -- unknown and revoked keys
_M.DICT_AUTH_FAIL = "infergate_auth_fail"  -- failed lookups per client address
_M.DICT_LIMITS = "infergate_limits"

-- The tenant of every request when auth is off.
_M.DEFAULT_TENANT = "default"

return _M
