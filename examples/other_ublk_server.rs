//! A ublk server that is not fdpblk, for the VM checks: `other_ublk_server add ID` serves a
//! 64 MiB null device of that id, tagged as another server's in its device info
//! (`ublksrv_flags`) and held by the driver for recovery when it dies, until killed;
//! `other_ublk_server del ID` deletes it.
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::{BufDescList, UblkDev, UblkIOCtx, UblkQueue};
use libublk::{BufDesc, UblkFlags, UblkIORes};
use std::rc::Rc;

/// Another server's tag: not fdpblk's.
const TAG: u64 = 0xbeef;

fn queue(qid: u16, dev: &UblkDev) {
    let bufs = Rc::new(dev.alloc_queue_io_bufs());
    let b = bufs.clone();
    let handler = move |q: &UblkQueue, tag: u16, _io: &UblkIOCtx| {
        let bytes = (q.get_iod(tag).nr_sectors << 9) as i32;
        let _ = q.complete_io_cmd_unified(tag, BufDesc::Slice(b[usize::from(tag)].as_slice()), Ok(UblkIORes::Result(bytes)));
    };
    let q = UblkQueue::new(qid, dev).expect("queue").submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs))).expect("fetch");
    q.wait_and_handle_io(handler);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: other_ublk_server add|del ID";
    let id: i32 = args.get(2).and_then(|s| s.parse().ok()).expect(usage);
    match args.get(1).map(String::as_str) {
        Some("add") => {
            let ctrl = UblkCtrlBuilder::default()
                .name("other")
                .id(id)
                .nr_queues(1)
                .depth(16)
                .ctrl_flags(u64::from(libublk::sys::UBLK_F_USER_RECOVERY))
                .ctrl_target_flags(TAG)
                .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
                .build()
                .expect("add");
            let init = |dev: &mut UblkDev| {
                dev.set_default_params(64 << 20);
                Ok(())
            };
            ctrl.run_target(init, queue, |c: &UblkCtrl| println!("serving /dev/ublkb{}", c.dev_info().dev_id)).expect("run");
        }
        Some("del") => {
            UblkCtrl::new_simple(id).expect("no such device").del_dev().expect("del");
        }
        _ => panic!("{usage}"),
    }
}
