"""``Trainer``: ``gluon.Trainer`` for parameters on any devices (MXNet 1.9.1's
``gluon/trainer.py``, subclassed; ``tests/upstream/`` runs its tests against
this class). docs/trainer.md lists what differs."""
from mxnet import gluon
from mxnet import optimizer as opt
from mxnet.kvstore import KVStore
from mxnet.model import _create_kvstore, _create_sparse_kvstore

from ..base.compat import kvstore_may_update, updates_by_device
from .updater import adam_step
from .optstate import OptimizerStateError, check_states, drop_states, load_states, \
    save_states, set_states_of, states_of

__all__ = []


class Trainer(gluon.Trainer):
    """Applies an optimizer to parameters placed on any devices: each on one
    device, several (replicas) or a mix. Each copy is updated by its own
    device's updater, beside its optimizer state; the state is saved by
    parameter name, without devices (:mod:`~mp_symbolic.core.optim.optstate`).

    Used as ``gluon.Trainer`` is (after ``autograd.backward()``, outside
    ``record()``): ``step(batch_size)``, or ``allreduce_grads()`` then
    ``update(batch_size)``.

    Args:
        params: A ``ParameterDict``, a dict or a list of ``Parameter`` s, each
            initialised on one device or several (its copies kept equal).
        optimizer: An ``mx.optimizer.Optimizer`` or its name (``'sgd'``, ...).
        optimizer_params: Keyword arguments of the optimizer given by name.
        kvstore: ``'device'``, ``'local'``, ``'dist_sync'``, ... or a
            ``KVStore``, summing the gradients of a parameter's copies (and of
            the workers); none is made when no parameter has several copies and
            no ``dist_*`` is asked for. A ``dist_*`` kvstore is set up here, so
            every worker starts from worker 0's values.
        compression_params: Gradient compression of the kvstore.
        update_on_kvstore: Whether the kvstore runs the optimizer. ``None``:
            Gluon's choice when every parameter is on the same devices, else
            ``False``.

    Raises:
        ValueError: ``params`` is not Parameters, lists a parameter twice,
            ``kvstore=None`` for a parameter with several copies, or an
            ``update_on_kvstore`` the kvstore cannot honour.
        RuntimeError: a parameter is not initialised, or a row_sparse
            parameter already has another Trainer (as Gluon).
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore='device',
                 compression_params=None, update_on_kvstore=None):
        listed = list(params.values()) if isinstance(params, (dict, gluon.ParameterDict)) \
            else params
        if isinstance(listed, (list, tuple)):
            names = [p.name for p in listed if isinstance(p, gluon.Parameter)]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError('params: expected each parameter once, found %s twice'
                                 % ', '.join(twice))
        super().__init__(params, optimizer, optimizer_params, kvstore=kvstore,
                         compression_params=compression_params,
                         update_on_kvstore=update_on_kvstore)
        if kvstore is None:
            several = [p for p in self._params if len(p.list_ctx()) > 1]
            if several:
                # gluon.Trainer would update each copy with its own gradient
                raise ValueError('kvstore: expected one (local, device or dist_sync) to sum the '
                                 'gradients of the copies of %s (on %s), found None (the copies '
                                 'would drift apart)' % (several[0].name, ', '.join(
                                     str(c) for c in several[0].list_ctx())))
        kind = kvstore.type if isinstance(kvstore, KVStore) else str(kvstore)
        if 'dist' in kind:
            # set up before any forward pass, as Module does, not at the first
            # step as Gluon does (docs/trainer.md: garbage weights otherwise)
            self._init_kvstore()
            self._init_params()  # parameters still deferred wait for the first step

    # -- placement -----------------------------------------------------------

    def _check_contexts(self):
        # Gluon asserts one set of contexts for all parameters; here every
        # device any parameter lives on, in order of first appearance. Gluon's
        # _init_optimizer then makes one Updater per entry (self._updaters).
        devices = []
        for param in self._params:
            for ctx in param.list_ctx():
                if ctx not in devices:
                    devices.append(ctx)
        return devices

    def _updater_on(self, ctx):
        """The updater of device ``ctx`` (one more if a parameter moved there)."""
        if ctx not in self._contexts:
            self._contexts.append(ctx)
            self._updaters.append(opt.get_updater(self._optimizer))
        return self._updaters[self._contexts.index(ctx)]

    # -- kvstore -------------------------------------------------------------

    def _init_kvstore(self):
        # Gluon's rules, rewritten because Gluon's version reads every
        # parameter on self._contexts[0] and counts len(self._contexts) as the
        # copies of each; here a parameter's copies are its own devices. One
        # rule differs: with parameters on different devices, update_on_kvstore
        # defaults to False, so that each copy's optimizer state stays beside
        # it (compat.kvstore_may_update says where MXNet would put it).
        config = self._kvstore_params
        copies = max((len(p.list_ctx()) for p in self._params), default=1)
        shapes = {p.name: p for p in self._params}  # _create_kvstore reads .shape only
        if self._contains_sparse_weight:
            kvstore, update_on_kvstore = _create_sparse_kvstore(config['kvstore'])
            self._distributed = 'dist' in kvstore.type
            if config['update_on_kvstore'] is False:
                raise ValueError('Cannot set update_on_kvstore=False when sparse weights '
                                 'are present.')
        elif self._contains_sparse_grad:
            kvstore, _ = _create_kvstore(config['kvstore'], copies, shapes)
            self._distributed = 'dist' in kvstore.type if kvstore else False
            update_on_kvstore = self._distributed
            if config['update_on_kvstore'] is not None:
                if config['update_on_kvstore'] is False and self._distributed:
                    raise ValueError('Cannot set update_on_kvstore=False on dist kvstore '
                                     'when sparse gradients are present.')
                update_on_kvstore = config['update_on_kvstore']
            if kvstore is not None and not isinstance(kvstore, KVStore):
                raise ValueError('Cannot use {} for multi-device training with sparse gradients'
                                 .format(type(kvstore)))
        else:
            kvstore, update_on_kvstore = _create_kvstore(config['kvstore'], copies, shapes)
            self._distributed = 'dist' in kvstore.type if kvstore else False
            if not kvstore_may_update(self._params):
                update_on_kvstore = False
            if self._distributed and 'async' in kvstore.type:
                update_on_kvstore = True
                if config['update_on_kvstore'] is False:
                    raise ValueError('Please set update_on_kvstore=True '
                                     'when training in async mode.')
            if config['update_on_kvstore'] is not None:
                update_on_kvstore = config['update_on_kvstore']
            if kvstore is None and config['update_on_kvstore']:
                raise ValueError('update_on_kvstore: expected False or None without a kvstore '
                                 '(no parameter has several copies and the kvstore is not '
                                 'dist_*), found True')
            if update_on_kvstore and (kvstore is None or not kvstore.is_capable('optimizer')):
                if config['update_on_kvstore']:
                    raise ValueError('Please set update_on_kvstore=False '
                                     'when training with {}'.format(type(kvstore)))
                update_on_kvstore = False
        if kvstore:
            if self._compression_params:
                kvstore.set_gradient_compression(self._compression_params)
            if update_on_kvstore:
                kvstore.set_optimizer(self._optimizer)
            self._kvstore = kvstore
            self._update_on_kvstore = update_on_kvstore
        else:
            self._kvstore = None
            self._update_on_kvstore = None
        self._kv_initialized = True

    @property
    def kvstore(self):
        """The kvstore summing gradients (``None`` before the first step or
        without one)."""
        return self._kvstore

    # -- update --------------------------------------------------------------

    def _update(self, ignore_stale_grad=False):
        # Gluon's _update zips a parameter's copies with self._updaters by
        # position, which holds only when every parameter has one copy per
        # context in the same order; here each copy goes to its device's
        # updater, and all of one device's parameters to it in one call
        # (MXNet's Updater fuses up to 4 of them per multi_*_update op, whatever
        # their devices: compat.updates_by_device).
        loss_scaler = getattr(self, '_amp_loss_scaler', None)
        if loss_scaler is not None and loss_scaler.has_overflow(self._params):
            return  # skip on overflow, as Gluon does
        on_kvstore = bool(self._kvstore and self._update_on_kvstore)
        indices, grads, weights = [], [], []
        for i, param in enumerate(self._params):
            if param.grad_req == 'null':
                continue
            copies = param._check_and_get(param._data, list)  # pylint: disable=protected-access
            if not ignore_stale_grad:
                for data in copies:
                    if not data._fresh_grad:  # pylint: disable=protected-access
                        raise UserWarning(
                            'Gradient of Parameter `%s` on context %s has not been updated '
                            'by backward since last `step`. This could mean a bug in your '
                            'model that made it only use a subset of the Parameters (Blocks) '
                            'for this iteration. If you are intentionally only using a subset, '
                            'call step with ignore_stale_grad=True to suppress this '
                            'warning and skip updating of Parameters with stale gradient'
                            % (param.name, str(data.context)))
            if on_kvstore:
                # the kvstore has updated every copy; Gluon leaves the flags set
                # here, which turns the stale-gradient check off from then on
                for data in copies:
                    data._fresh_grad = False  # pylint: disable=protected-access
                continue
            for data, grad in zip(param.list_data(), param.list_grad()):
                if not ignore_stale_grad or data._fresh_grad:  # pylint: disable=protected-access
                    indices.append(i)
                    grads.append(grad)
                    weights.append(data)
                    data._fresh_grad = False  # pylint: disable=protected-access
        for part in updates_by_device(indices, grads, weights):
            updater = self._updater_on(part[2][0].context)
            if not adam_step(updater, *part):   # Adam in one pass, the updater's result
                updater(*part)

    # -- optimizer state by name ---------------------------------------------

    def _ensure_kvstore(self):
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()

    def states(self, lazy=False):
        """The optimizer state by parameter name, as numpy, without devices (one per
        parameter, whatever its copies).

        Args:
            lazy: Each array a function of no arguments making it on the host.

        Raises:
            ValueError: the optimizer runs on a dist kvstore's servers.
        """
        self._ensure_kvstore()
        if self._update_on_kvstore:
            updater = self._kvstore_updater('save_states')
            sources = [(p.name, i, updater) for i, p in enumerate(self._params)]
        else:
            sources = [(p.name, i, self._updater_on(p.list_ctx()[0]))
                       for i, p in enumerate(self._params)]
        return states_of(self._optimizer, sources, lazy=lazy)

    def set_states(self, states):
        """Restores :meth:`states` output onto each copy's own device, whatever
        placement it was saved on (states of ``grad_req='null'`` parameters
        dropped).

        Raises:
            OptimizerStateError: state of another optimizer, or of a parameter
                this Trainer does not have.
            ValueError: the optimizer runs on a dist kvstore's servers.
        """
        self._ensure_kvstore()
        states = drop_states(states, [p.name for p in self._params if p.grad_req == 'null'])
        count_ids = sorted({ctx.device_id for ctx in self._contexts} | {0})
        targets = {}
        for i, param in enumerate(self._params):
            if self._update_on_kvstore:
                # the kvstore's updater moves the state to its merge buffer's
                # device on first use; its count is kept under every device id
                targets[param.name] = [(self._kvstore_updater('load_states'), i, None,
                                        count_ids)]
            else:
                targets[param.name] = [(self._updater_on(ctx), i, ctx, [ctx.device_id])
                                       for ctx in param.list_ctx()]
        set_states_of(self._optimizer, states, targets)

    def _kvstore_updater(self, what):
        updater = getattr(self._kvstore, '_updater', None)
        if updater is None:
            raise ValueError('%s: expected the optimizer state in this process, found it on the '
                             "%s kvstore's servers (use update_on_kvstore=False)"
                             % (what, self._kvstore.type))
        return updater

    def save_states(self, fname):
        """Saves the optimizer state by parameter name, without devices, to
        ``fname`` (an ``.npz`` file, not a pickle)."""
        save_states(fname, self.states())

    def load_states(self, fname):
        """Loads :meth:`save_states` output onto this placement, which may differ
        from the one it was saved on; the optimizer keeps its hyper-parameters,
        its update counts come from the file.

        Raises:
            OptimizerStateError: the file is unreadable, truncated or forged, or
                holds another optimizer's or another model's state (another shape
                included).
        """
        states = load_states(fname)
        known = {p.name: p.shape for p in self._params if p.shape and all(p.shape)}
        try:
            check_states(states, known)  # else MXNet fails in the first update, or not at all
        except OptimizerStateError as err:
            raise OptimizerStateError('%s: %s' % (fname, err)) from None
        self.set_states(states)
