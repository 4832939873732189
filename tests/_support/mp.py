"""Launch test processes: mpirun ranks and jax.distributed processes."""
import contextlib
import os
import socket
import subprocess
import sys
import time

from cores import launch

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)


def add_launch_args(parser):
    """Arguments of a test process started by :func:`distributed`."""
    parser.add_argument("--distributed", type=int, default=0, help="number of processes")
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)


def init_jax_distributed(args):
    """Initialize jax.distributed when started by :func:`distributed`."""
    import jax
    if args.distributed:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                                   num_processes=args.distributed, process_id=args.process_id)


#: where test processes keep their compilation caches (set by conftest for
#: the test session, which removes it at the end)
CACHE_ROOT = "CHEMTRAIN_TEST_CACHE_ROOT"


#: the size limit that also makes JAX read and write the cache under its file lock
CACHE_BYTES = 4 << 30


def session_compile_cache():
    """Use the test session's JAX compilation cache: tests and test scripts
    build the same small programs in many launches (and many trainers), in
    the pytest processes (xdist workers) and the processes they start, and
    compile each once.

    One folder for all of them: with a size limit, JAX reads and writes an
    entry only under its lock file, so no process sees half an entry (as
    :mod:`chemtrain.compile_cache` relies on for users' runs)."""
    import jax
    root = os.environ.get(CACHE_ROOT)
    if not (root and os.path.isdir(root)):
        return
    jax.config.update("jax_compilation_cache_dir", os.path.join(root, "jax"))
    jax.config.update("jax_compilation_cache_max_size", CACHE_BYTES)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def env(devices=1, **extra):
    e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    e["JAX_PLATFORMS"] = "cpu"
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    e["PYTHONPATH"] = os.pathsep.join([HERE, e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.update(extra)
    return e


def mpirun(n, script_args, devices=1, timeout=300, **extra):
    """Run tests/mp_run.py (or ``-c`` code) on ``n`` MPI ranks; return
    (returncode, combined output, seconds)."""
    mpirun_bin = os.path.join(BIN, "mpirun")
    if not os.path.exists(mpirun_bin):
        raise RuntimeError(f"{mpirun_bin} not found: run scripts/setup.sh (installs the mpich wheel).")
    cmd = [mpirun_bin, "-np", str(n), sys.executable, *script_args]
    with launch() if n > 1 else contextlib.nullcontext():
        t = time.perf_counter()
        out = subprocess.run(cmd, env=env(devices, **extra), capture_output=True, text=True,
                             timeout=timeout)
        return out.returncode, out.stdout + out.stderr, time.perf_counter() - t


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed(n, script_args, devices=1, timeout=300, script="mp_run.py"):
    """Run ``n`` jax.distributed processes of ``tests/<script>``; return
    (list of return codes, combined output)."""
    with launch() if n > 1 else contextlib.nullcontext():
        return _distributed(n, script_args, devices, timeout, script)


def _distributed(n, script_args, devices, timeout, script):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, script), *script_args,
                               "--distributed", str(n), "--process-id", str(i), "--port", str(port)],
                              env=env(devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(n)]
    outs, codes = [], []
    deadline = time.time() + timeout
    for p in procs:
        try:
            o, _ = p.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            o, _ = p.communicate()
        outs.append(o)
        codes.append(p.returncode)
    return codes, "\n".join(outs)
