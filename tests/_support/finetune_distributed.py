"""One jax.distributed process of a ``chemtrain-finetune`` job (started by
``mp.distributed``): ``finetune_distributed.py ARGV_JSON --distributed N
--process-id I --port P``."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def main():
    import mp
    parser = argparse.ArgumentParser()
    parser.add_argument("argv", help="the job's flags as a JSON list")
    mp.add_launch_args(parser)
    args = parser.parse_args()
    mp.init_jax_distributed(args)
    from chemtrain.finetune import run
    run(json.loads(args.argv))


if __name__ == "__main__":
    main()
