"""``inferd fleet``: one host, many workers — nginx in front, supervisord behind, GPUs bound.

layout   who runs where: ports, GPU, memory fraction and threads of each worker (pure, unit-tested);
render   the run folder: nginx.conf and supervisord.conf from deploy/ templates, the workers' configuration;
runner   the foreground command: supervisord as a child, signals, the /health/fleet file;
control  supervisord (XML-RPC on its unix socket) and the workers (HTTP): status, model changes to all;
command  the argparse side of ``inferd fleet [reload|canary|promote|rollback|status]``.

Nothing in core/ or api/ knows about the fleet: a worker is exactly ``inferd serve``.
"""
