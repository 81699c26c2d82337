"""The service layer: what chatd does for a caller, in its own types (chatd.service.types).

``core`` wires the parts and offers the operator's operations, ``sessions`` the session operations and their
one-change-at-a-time rule, ``turns`` carries a turn out (commit, lease the cache, generate, commit), ``pool`` keeps
the stateless requests' caches, ``stats`` is the read model. The edges (chatd.server, chatd.cli) map these types to
and from the wire's models; nothing here imports a wire model.
"""
