"""What drives the passes, above them: the pass manager (a plan's passes checked, ordered, bound
to their options and run), :func:`~zerocc.compiler.driver.program.compile_program` (capture,
then the passes), the compile session (:mod:`.session`: what every program of one model, plan
and world shares, set up once) and the plans one change away from a plan (each checked as a
plan is)."""
