"""The serving co-executor (ROSE §4.1, App. C): RL rollouts on a serving GPU inside the serving
SLO slack. Pure core so far: ``page_pool`` (one paged KV pool, serving first),
``memory_sharing`` (B_roll, the burst cut, the freeze, reclaim order), ``latency_profile``
(T_prf(L, m), T_dec(b), online correction), ``admission`` (dual-SLO slack, Eq. 1-2, and the
variants) and ``scheduler`` (one tick, one forward: serving first). Every class is synchronous,
free of I/O and takes the time as an argument.
"""
