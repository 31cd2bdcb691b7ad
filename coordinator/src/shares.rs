//! Per-user shares of a bounded pool: no one user can take what every other user, and
//! the administrators, need. One reader once held all 256 SSE log streams of a node, and
//! the administrator then got 503.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cumulus_api::Role;
use cumulus_api::users::Principal;

/// Fraction of a pool one non-administrator may hold: `1 / USER_SHARE_DIVISOR` of it (at
/// least one slot).
pub const USER_SHARE_DIVISOR: usize = 4;
/// Fraction of a pool only administrators may take: its last `1 / ADMIN_RESERVE_DIVISOR`
/// (at least one slot), so a crowd of users still leaves an administrator room.
pub const ADMIN_RESERVE_DIVISOR: usize = 8;

/// A pool of `capacity` slots with a per-user cap and an administrators' reserve.
#[derive(Debug)]
pub struct SharedSlots {
    capacity: usize,
    inner: Arc<Mutex<Held>>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    by_user: HashMap<String, usize>,
}

/// Why a slot is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SlotRefusal {
    /// The whole pool (for this principal: all but the administrators' reserve) is held.
    #[error("all {available} slots this caller may use are held")]
    PoolFull {
        /// Slots this principal may use in all.
        available: usize,
    },
    /// This user holds its whole share.
    #[error("this user holds its share of {share} of {capacity} slots")]
    UserShare {
        /// The user's share.
        share: usize,
        /// The pool's size.
        capacity: usize,
    },
}

/// One held slot; given back on drop.
#[derive(Debug)]
pub struct SlotPermit {
    inner: Arc<Mutex<Held>>,
    user: String,
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        let mut held = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        held.total = held.total.saturating_sub(1);
        if let Some(n) = held.by_user.get_mut(&self.user) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.by_user.remove(&self.user);
            }
        }
    }
}

impl SharedSlots {
    /// A pool of `capacity` slots.
    pub fn new(capacity: usize) -> SharedSlots {
        SharedSlots {
            capacity,
            inner: Arc::default(),
        }
    }

    /// Slots one non-administrator may hold.
    pub fn user_share(&self) -> usize {
        (self.capacity / USER_SHARE_DIVISOR).max(1)
    }

    /// Slots only administrators may take.
    pub fn admin_reserve(&self) -> usize {
        (self.capacity / ADMIN_RESERVE_DIVISOR)
            .max(1)
            .min(self.capacity)
    }

    /// A slot for `who`: an administrator may take any free slot; anyone else at most
    /// [`SharedSlots::user_share`] at once, and none of the administrators' reserve.
    ///
    /// # Errors
    /// [`SlotRefusal`] saying which bound is met.
    pub fn try_acquire(&self, who: &Principal) -> Result<SlotPermit, SlotRefusal> {
        let mut held = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let admin = who.role == Role::Admin;
        let available = if admin {
            self.capacity
        } else {
            self.capacity - self.admin_reserve()
        };
        if held.total >= available {
            return Err(SlotRefusal::PoolFull { available });
        }
        let mine = held.by_user.get(&who.name).copied().unwrap_or(0);
        if !admin && mine >= self.user_share() {
            return Err(SlotRefusal::UserShare {
                share: self.user_share(),
                capacity: self.capacity,
            });
        }
        held.total += 1;
        *held.by_user.entry(who.name.clone()).or_default() += 1;
        Ok(SlotPermit {
            inner: self.inner.clone(),
            user: who.name.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(name: &str, role: Role) -> Principal {
        Principal {
            name: name.into(),
            role,
        }
    }

    #[test]
    fn one_user_cannot_take_the_pool_and_admins_keep_a_reserve() {
        let slots = SharedSlots::new(256);
        let reader = user("ann", Role::Read);
        let held: Vec<_> = (0..64)
            .map(|_| slots.try_acquire(&reader).expect("within the share"))
            .collect();
        assert_eq!(
            slots.try_acquire(&reader).expect_err("past the share"),
            SlotRefusal::UserShare {
                share: 64,
                capacity: 256
            }
        );
        // Other users fill what is left but the administrators' reserve.
        let mut others = Vec::new();
        for k in 0.. {
            match slots.try_acquire(&user(&format!("u{k}"), Role::Submit)) {
                Ok(p) => others.push(p),
                Err(e) => {
                    assert_eq!(e, SlotRefusal::PoolFull { available: 224 });
                    break;
                }
            }
        }
        assert_eq!(held.len() + others.len(), 224);
        // An administrator still gets a slot, up to the whole pool.
        let admins: Vec<_> = (0..32)
            .map(|_| {
                slots
                    .try_acquire(&Principal::cluster_admin())
                    .expect("reserve")
            })
            .collect();
        assert!(slots.try_acquire(&Principal::cluster_admin()).is_err());
        // Slots come back on drop, per user too.
        drop(held);
        drop(admins);
        assert!(slots.try_acquire(&reader).is_ok());
    }

    #[test]
    fn tiny_pools_keep_at_least_one_slot_each_way() {
        let slots = SharedSlots::new(1);
        assert_eq!((slots.user_share(), slots.admin_reserve()), (1, 1));
        assert!(slots.try_acquire(&user("ann", Role::Read)).is_err());
        let _p = slots
            .try_acquire(&Principal::cluster_admin())
            .expect("the admin");
    }
}
