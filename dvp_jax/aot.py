"""`python -m dvp_jax.aot`: the planning wing's command (`dvp_jax.plan.aot`, whose docstring
says what it compiles and prints), kept at this name because every doc, config and test runs it.
"""

from dvp_jax.plan.aot import run

if __name__ == "__main__":
    run()
